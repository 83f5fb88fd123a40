"""The code's shape, read from the source with `ast` (nothing of `app` is imported): no import cycle among app's
modules, no import of a higher layer from a lower one (nor, inside the engine, of a higher room from a
lower one), no function of 60 lines or more, no blocking file, database
or object-store call in a coroutine's own body (where it would stall its event loop; `app.core.blocking` catches the
database and store calls the tests reach at run time, this the ones they do not), and no write of a batch's
ending outside the one function that writes them all.

Every import counts wherever it is written: at the top, inside a function (a real dependency, only later), and
under `if TYPE_CHECKING:` (a type names what the module is built on as much as a call does).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"

# Lowest first: a module imports from its own layer and those below, never from one above. "app" alone is the
# package itself (its version), which any module may read.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("app", "app.core")),
    ("domain", ("app.domain",)),
    ("engine", ("app.engine",)),
    ("http", ("app.api", "app.console", "app.outbox")),
    (
        "wiring",
        (
            "app.main",
            "app.openapi",
            "app.launch",
            "app.cli",
            "app.cluster",
            "app.testing",
            "app.__main__",
            "app.reference",
        ),
    ),
)
# Inside the engine, its rooms (`app/engine/__init__.py` says what each owns), lowest first: a room's modules import
# from their own room and those below, never from one above. Above them all, the entry that wires them: the package
# itself and `app.engine.service`. A module of the engine in no room (one added beside `service.py`) fails too.
ENGINE_ROOMS: tuple[str, ...] = ("inference", "telemetry", "sharing", "online", "batch", "scheduling")
ENGINE_ENTRY: tuple[str, ...] = ("app.engine", "app.engine.service")
MAX_FUNCTION_LINES = 59
# Calls that hold the thread they run on for as long as the disk, the database or the store takes: in a coroutine they
# go through asyncio.to_thread (or aiofiles, or obstore's *_async).
BLOCKING_FUNCTIONS = frozenset({
    "open", "os.fsync", "os.fdatasync", "_fsync_dir", "shutil.rmtree", "shutil.copyfile", "shutil.copy",
    "shutil.copy2", "shutil.copyfileobj", "shutil.move", "session_scope", "write_scope", "read_scope", "Session",
})  # fmt: skip
BLOCKING_METHODS = frozenset({"unlink", "rmdir", "write_text", "write_bytes", "read_text", "read_bytes"})
# Allowed where they are, each with its reason: "file:coroutine: call".
BLOCKING_ALLOWED = {
    # obstore.list only builds a stream; its pages are fetched by the awaited collect_async() or `async for`.
    "app/core/object_storage.py:delete: obstore.list",
    "app/core/object_storage.py:_segments_of: obstore.list",
}

# The writes that can end a batch (`app.domain.batches`): a terminal status is written by one function,
# `app.engine.batch.ending._write_end`, which every ending (the run's one exit, `ending.end`, and the watchdog's
# `end_overdue`) reaches through `cancel_wins`. A `transition` ends one unless its `to=` names a status that is not
# final. Allowed elsewhere, each with its reason: "file:function" (none: nothing outside a run ends a batch).
ENDING_WRITES = frozenset({"end_with_files", "end_with_errors", "transition"})
NOT_FINAL = frozenset({"VALIDATING", "IN_PROGRESS", "FINALIZING", "CANCELLING"})
ENDING_WRITER = "app/engine/batch/ending.py:_write_end"
ENDING_WRITES_ALLOWED: dict[str, str] = {}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    where: str  # file and line


def modules(root: Path) -> dict[str, Path]:
    """Every module under `root` (a package directory) by its dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(root: Path) -> list[Import]:
    """Every import of one of `root`'s modules by another, wherever in the module it is written."""
    known = modules(root)
    found = []
    for source, path in known.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, known):
                if target != source:
                    found.append(Import(source, target, f"{path.relative_to(root.parent)}:{node.lineno}"))
    return found


def _targets(node: ast.AST, package: str, known: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield from _owning_module(alias.name, known)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            above = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*above, *([node.module] if node.module else [])])
        for alias in node.names:  # `from package import module` depends on the module, not only the package
            yield from _owning_module(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, known)


def _owning_module(name: str, known: dict[str, Path]) -> Iterator[str]:
    while name and name not in known:
        name = name.rpartition(".")[0]
    if name:
        yield name


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or (prefix != "app" and module.startswith(prefix + ".")) for prefix in prefixes):
            return rank
    return None


def room_of(module: str) -> int | None:
    """The rank of an engine module's room (the entry's: above every room); None outside the engine or in no room."""
    if module in ENGINE_ENTRY:
        return len(ENGINE_ROOMS)
    for rank, room in enumerate(ENGINE_ROOMS):
        if module == f"app.engine.{room}" or module.startswith(f"app.engine.{room}."):
            return rank
    return None


def upward_imports(found: list[Import]) -> list[str]:
    return _upward(found, layer_of, [name for name, _ in LAYERS], "layer")


def upward_room_imports(found: list[Import]) -> list[str]:
    return _upward(found, room_of, [*ENGINE_ROOMS, "entry"], "room")


def _upward(found: list[Import], rank_of: Callable[[str], int | None], names: list[str], kind: str) -> list[str]:
    """The imports from a lower `kind` to a higher one, as `rank_of` ranks modules."""
    problems = []
    for edge in found:
        source, target = rank_of(edge.source), rank_of(edge.target)
        if source is not None and target is not None and target > source:
            problems.append(
                f"{edge.where} {edge.source} imports {edge.target}: "
                f"{kind} {names[source]} may not import from {kind} {names[target]}"
            )
    return problems


def roomless(root: Path) -> list[str]:
    return [name for name in modules(root) if name.startswith("app.engine.") and room_of(name) is None]


def cycles(found: list[Import]) -> list[str]:
    """One cycle per strongly connected group of modules, each import of it named with its file and line."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in found:
        graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
    problems = []
    for group in _strongly_connected(graph):
        if len(group) > 1:
            path = _cycle_through(graph, group)
            steps = [graph[a][b] for a, b in itertools.pairwise(path)]
            members = ", ".join(sorted(group))
            closed = " -> ".join(f"{s.source} ({s.where})" for s in steps) + f" -> {path[0]}"
            problems.append(f"import cycle among {members}: {closed}")
    return problems


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in graph.get(node, {}):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = set()
            while (member := stack.pop()) != node:
                group.add(member)
            groups.append(group | {node})

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _cycle_through(graph: dict[str, dict[str, Import]], group: set[str]) -> list[str]:
    """A closed path inside `group`, from its first module back to it."""
    start = min(group)
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for after in sorted(graph.get(path[-1], {})):
            if after == start:
                return [*path, start]
            if after in group and after not in path:
                paths.append([*path, after])
    raise AssertionError(f"no cycle through {group}")


def long_functions(root: Path) -> list[str]:
    problems = []
    for path in modules(root).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    problems.append(f"{where} {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
    return problems


def _called(func: ast.expr) -> str:
    """`os.fsync`, `.unlink` (a method of any object), `open`, ...: how a call names what it calls."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        inner = _called(func.value)
        return f"{inner}.{func.attr}" if inner else f".{func.attr}"
    return ""


def _calls_on_the_loop(coroutine: ast.AsyncFunctionDef) -> Iterator[ast.Call]:
    """The calls a coroutine makes itself and does not await: not those of a nested def or lambda, which run wherever
    they are handed (asyncio.to_thread)."""
    stack: list[ast.AST] = list(coroutine.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Await) and isinstance(node.value, ast.Call):
            stack.extend(ast.iter_child_nodes(node.value))  # the awaited call is a coroutine's; its arguments are not
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _blocks(name: str) -> bool:
    method = name.rsplit(".", 1)[-1]
    sync_store = name.startswith("obstore.") and not name.endswith("_async")
    return name in BLOCKING_FUNCTIONS or ("." in name and method in BLOCKING_METHODS) or sync_store


def blocking_calls(root: Path) -> list[str]:
    problems = []
    for path in modules(root).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.AsyncFunctionDef):
                continue
            for call in sorted(_calls_on_the_loop(node), key=lambda call: (call.lineno, call.col_offset)):
                name = _called(call.func)
                where = f"{path.relative_to(root.parent)}:{node.name}: {name}"
                if _blocks(name) and where not in BLOCKING_ALLOWED:
                    problems.append(f"{where} (line {call.lineno}) blocks the event loop: asyncio.to_thread it")
    return problems


def ending_writes(root: Path) -> list[tuple[str, str, int]]:
    """Each write that can end a batch, called or handed on (`asyncio.to_thread(batches.end_with_files, ...)`): the
    "file:function" it is in, the write, its line."""
    found = []
    for path in modules(root).values():
        where = str(path.relative_to(root.parent))
        for function in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for call in _own_calls(function):
                for named in (call.func, *call.args):
                    write = _called(named).rsplit(".", 1)[-1]
                    if write in ENDING_WRITES and _can_end(write, call):
                        found.append((f"{where}:{function.name}", write, call.lineno))
    return sorted(found, key=lambda found: (found[0], found[2]))


def _own_calls(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.Call]:
    """The calls in `function`'s body, not in a def nested in it (which is walked as a function of its own)."""
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _can_end(write: str, call: ast.Call) -> bool:
    if write != "transition":
        return True
    to = next((keyword.value for keyword in call.keywords if keyword.arg == "to"), None)
    return not (isinstance(to, ast.Attribute) and to.attr in NOT_FINAL)


def misplaced_ending_writes(root: Path) -> list[str]:
    return [
        f"{where} (line {line}) writes a batch's ending ({write}): only {ENDING_WRITER} may"
        for where, write, line in ending_writes(root)
        if where != ENDING_WRITER and where not in ENDING_WRITES_ALLOWED
    ]


def test_every_module_has_a_layer():
    problems = [name for name in modules(APP) if layer_of(name) is None]
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    problems = cycles(imports(APP))
    assert not problems, "\n".join(problems)


def test_no_import_from_a_higher_layer():
    problems = upward_imports(imports(APP))
    assert not problems, "\n".join(problems)


def test_every_engine_module_has_a_room():
    problems = roomless(APP)
    assert not problems, "\n".join(problems)


def test_no_engine_room_imports_from_a_room_above():
    problems = upward_room_imports(imports(APP))
    assert not problems, "\n".join(problems)


def test_no_function_reaches_60_lines():
    problems = long_functions(APP)
    assert not problems, "\n".join(problems)


def test_no_coroutine_blocks_its_loop_on_files_the_database_or_the_store():
    problems = blocking_calls(APP)
    assert not problems, "\n".join(problems)


def test_every_ending_is_written_by_one_function():
    problems = misplaced_ending_writes(APP)
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_ending_writes_that_are_there():
    """The guard above passes on no write at all too: it means something only while the scan finds the writes."""
    written = {write for where, write, _ in ending_writes(APP) if where == ENDING_WRITER}
    assert written == {"end_with_files", "end_with_errors", "transition"}


def test_the_scan_sees_the_imports_that_are_there():
    """The guards above pass on an empty graph too: they mean something only while the scan finds what is there."""
    found = {(edge.source, edge.target) for edge in imports(APP)}
    assert ("app.main", "app.api.batches") in found  # `from app.api import batches as ...`
    assert ("app.cli", "app.engine.batch.offline") in found  # inside a function
    assert ("app.engine.batch.runner", "app.engine.sharing.execution") in found  # between two rooms


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "app" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "app"


def test_each_guard_names_what_breaks_it(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    app = _package(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "def late():\n    from app.domain import b\n",
            "domain/__init__.py": "",
            "domain/b.py": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.core import a\n"
            f"def long():\n{long_body}",
        },
    )
    found = imports(app)
    assert upward_imports(found) == [
        "app/core/a.py:2 app.core.a imports app.domain.b: layer core may not import from layer domain"
    ]
    assert cycles(found) == [
        "import cycle among app.core.a, app.domain.b: "
        "app.core.a (app/core/a.py:2) -> app.domain.b (app/domain/b.py:3) -> app.core.a"
    ]
    blocking = _package(
        tmp_path / "blocking",
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/c.py": "import asyncio, os\n"
            "async def save(path, fd, db):\n"
            "    os.fsync(fd)\n"
            "    await asyncio.to_thread(os.fsync, fd)\n"
            "    await asyncio.to_thread(lambda: path.unlink())\n"
            "    with write_scope(db) as session:\n"
            "        path.unlink(missing_ok=True)\n"
            "    await path.read_bytes()\n",
        },
    )
    assert blocking_calls(blocking) == [
        f"app/core/c.py:save: {name} (line {line}) blocks the event loop: asyncio.to_thread it"
        for name, line in (("os.fsync", 3), ("write_scope", 6), ("path.unlink", 7))
    ]
    too_long = MAX_FUNCTION_LINES + 1
    assert long_functions(app) == [f"app/domain/b.py:4 long is {too_long} lines (at most {MAX_FUNCTION_LINES})"]


def test_the_room_guard_names_what_breaks_it(tmp_path):
    app = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/service.py": "from app.engine.batch import b\n",  # the entry wires the rooms: allowed
            "engine/loose.py": "",
            "engine/sharing/__init__.py": "",
            "engine/sharing/a.py": "from app.engine.batch.b import run\n",
            "engine/batch/__init__.py": "",
            "engine/batch/b.py": "def run():\n    from app.engine import service\n",
        },
    )
    assert upward_room_imports(imports(app)) == [
        "app/engine/batch/b.py:2 app.engine.batch.b imports app.engine.service: "
        "room batch may not import from room entry",
        "app/engine/sharing/a.py:1 app.engine.sharing.a imports app.engine.batch.b: "
        "room sharing may not import from room batch",
    ]
    assert roomless(app) == ["app.engine.loose"]


def test_the_ending_guard_names_what_breaks_it(tmp_path):
    app = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/batch/__init__.py": "",
            "engine/batch/ending.py": "async def _write_end(run, status):\n"
            "    await asyncio.to_thread(batches.end_with_files, db=run.db, to=status)\n"
            "    batches.transition(db=run.db, to=BatchStatus.CANCELLED)\n",
            "engine/batch/runner.py": "async def finish(run, status):\n"
            "    await asyncio.to_thread(batches.transition, db=run.db, to=BatchStatus.FINALIZING)\n"
            "    await asyncio.to_thread(batches.end_with_errors, db=run.db, to=status, errors=[])\n"
            "    def cancel():\n"
            "        batches.transition(db=run.db, batch_id=run.id, to=BatchStatus.CANCELLED)\n"
            "    await asyncio.to_thread(batches.transition, db=run.db, to=status)\n",
        },
    )
    assert misplaced_ending_writes(app) == [
        f"app/engine/batch/runner.py:{function} (line {line}) writes a batch's ending ({write}): "
        f"only {ENDING_WRITER} may"
        for function, line, write in (
            ("cancel", 5, "transition"),
            ("finish", 3, "end_with_errors"),
            ("finish", 6, "transition"),
        )
    ]
