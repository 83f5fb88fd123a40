"""One batch's story as a reader follows it (issue 40): from the batch's entry, `app.engine.batch.runner.run_batch`,
wherever its `Run` is handed, how many functions the reader stops at, in how many modules, and how often they come
back to a module they had left. Read from the source with `ast`; nothing of `app` is imported.

A stop is a function of the batch package (`app/engine/batch/`) that the Run is handed to: a call that passes it
(`run`, `self.run`), or hands on beside it a function of the package (`partial(_finalizing, run)`,
`asyncio.to_thread(_look_at_shards, ctx, run)`). A class that holds the Run (`BatchRun`) is one stop: its methods
are read together, and what any of them hands the Run on to is followed from there. The Run's own methods
(`run.stored()`) are the handle itself, read like its fields: they are no stops. The walk goes depth first in source
order, each stop once, and after each callee the reader is back in its caller's module: a return is each time they
are in a module again after they had left it. It also counts the call sites outside `ending.py` that ask
`ending.py` for an ending (a function of it named `end...`).

  .venv/bin/python -m bench.story_walk            # the numbers
  .venv/bin/python -m bench.story_walk --trace    # and each stop, indented by depth, with its module
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"
PACKAGE = "app.engine.batch"
ENTRY = ("runner", "run_batch")
RUN_CLASS = ("run", "Run")

Target = tuple[str, str]  # (module of the package, function or Class.method)


@dataclass
class Module:
    name: str
    tree: ast.Module
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imported: dict[str, Target] = field(default_factory=dict)  # a name bound to a function or class of the package
    modules: dict[str, str] = field(default_factory=dict)  # a name bound to a module of the package


def load(package_dir: Path) -> dict[str, Module]:
    found = {}
    for path in sorted(package_dir.glob("*.py")):
        module = Module(path.stem, ast.parse(path.read_text(), str(path)))
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                module.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                module.classes[node.name] = node
            elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
                module.modules.update({alias.asname or alias.name: alias.name for alias in node.names})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
                source = node.module.rpartition(".")[2]  # type: ignore[union-attr]
                module.imported.update({alias.asname or alias.name: (source, alias.name) for alias in node.names})
        found[module.name] = module
    return found


class Walk:
    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self.holders = {(m.name, c.name) for m in modules.values() for c in m.classes.values() if _holds_run(c)}
        self.holders.discard(RUN_CLASS)
        self.stops: list[tuple[int, Target]] = []
        self.trail: list[str] = []  # the module the reader is in, at each step

    def go(self, target: Target, depth: int = 0) -> None:
        self.stops.append((depth, target))
        self.trail.append(target[0])
        for callee in self.callees(target):
            if callee not in {stop for _, stop in self.stops}:
                self.go(callee, depth + 1)
                self.trail.append(target[0])

    def callees(self, target: Target) -> Iterator[Target]:
        module = self.modules[target[0]]
        held = target in self.holders
        cls = target[1] if held else target[1].rpartition(".")[0]
        node = self._definition(target)
        names = _run_names(node)
        calls = sorted(
            (n for n in ast.walk(node) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset, n.end_lineno or 0, n.end_col_offset or 0),
        )
        for call in calls:
            args = [*call.args, *(keyword.value for keyword in call.keywords)]
            hands_run = any(_is_run(arg, names, held) for arg in args)
            for named in (call.func, *args):
                found = self._resolve(named, module, cls)
                if found is not None and found != target and (hands_run or found in self.holders):
                    yield found

    def _resolve(self, expr: ast.expr, module: Module, cls: str) -> Target | None:
        """The package's function, or class that holds the Run, that `expr` names (called or handed on); None for
        any other (the Run's own methods among them)."""
        if isinstance(expr, ast.Name) and expr.id in module.imported:
            return self._unit(module.imported[expr.id])
        if isinstance(expr, ast.Name):
            return self._unit((module.name, expr.id))
        if not isinstance(expr, ast.Attribute):
            return None
        base = expr.value
        if isinstance(base, ast.Name) and base.id == "self" and cls:
            return self._unit((module.name, f"{cls}.{expr.attr}"))
        if isinstance(base, ast.Name) and base.id in module.modules:
            return self._unit((module.modules[base.id], expr.attr))
        if isinstance(base, ast.Call):  # `BatchRun(ctx, run).to_end()`
            made = self._resolve(base.func, module, cls)
            if made is not None and made in self.holders:
                return made
        return None

    def _unit(self, target: Target) -> Target | None:
        """`target` as a stop: a class that holds the Run is one (its methods read together), a function another."""
        module_name, name = target
        module = self.modules.get(module_name)
        if module is None or module_name == RUN_CLASS[0]:
            return None
        cls, _, method = name.partition(".")
        if (module_name, cls) in self.holders:
            return (module_name, cls)
        if not method and name in module.functions:
            return target
        if method and cls in module.classes and self._method(module.classes[cls], method) is not None:
            return target
        return None

    def _definition(self, target: Target) -> ast.AST:
        module = self.modules[target[0]]
        cls, _, name = target[1].rpartition(".")
        if target in self.holders:
            return module.classes[target[1]]
        if not cls:
            return module.functions[name]
        found = self._method(module.classes[cls], name)
        assert found is not None
        return found

    @staticmethod
    def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        methods = (n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        return next((n for n in methods if n.name == name), None)


def _holds_run(cls: ast.ClassDef) -> bool:
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign)]
    annotated = [arg.annotation for arg in init.args.args] if init else []
    return any(isinstance(a, ast.Name) and a.id == "Run" for a in [*annotated, *(f.annotation for f in fields)])


def _run_names(node: ast.AST) -> set[str]:
    names = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in inner.args.args + inner.args.kwonlyargs:
                if arg.arg == "run" or (isinstance(arg.annotation, ast.Name) and arg.annotation.id == "Run"):
                    names.add(arg.arg)
        if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store) and inner.id == "run":
            names.add(inner.id)
    return names


def _is_run(expr: ast.expr, names: set[str], held: bool) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in names
    return held and isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.attr == "run"


def returns(trail: list[str]) -> int:
    """How often the reader is in a module again after leaving it."""
    collapsed = [m for i, m in enumerate(trail) if i == 0 or trail[i - 1] != m]
    return sum(1 for i, m in enumerate(collapsed) if m in collapsed[:i])


def ending_calls(app: Path) -> list[str]:
    """Call sites outside `ending.py` of a function of it named `end...`."""
    ending = ast.parse((app / "engine/batch/ending.py").read_text())
    endings = {n.name for n in ending.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    endings = {name for name in endings if name.startswith("end")}
    found = []
    for path in sorted(app.rglob("*.py")):
        if path == app / "engine/batch/ending.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        imported = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == f"{PACKAGE}.ending"
            for alias in node.names
            if alias.name in endings
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            via_module = (
                isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "ending"
            )
            if (name in imported) or (via_module and name in endings):
                found.append((str(path.relative_to(app.parent)), node.lineno, name))
    return [f"{path}:{line} {name}" for path, line, name in sorted(found)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="store_true", help="print each stop, indented by its depth")
    args = parser.parse_args()
    walk = Walk(load(APP / "engine" / "batch"))
    walk.go(ENTRY)
    if args.trace:
        for depth, (module, name) in walk.stops:
            print(f"{'  ' * depth}{module}.py {name}")
    entries = Counter(m for i, m in enumerate(walk.trail) if i == 0 or walk.trail[i - 1] != m)
    modules = sorted({module for _, (module, _) in walk.stops})
    asked = ending_calls(APP)
    print(f"stops: {len(walk.stops)}")
    print(f"modules: {len(modules)} ({', '.join(modules)})")
    print(f"returns to a module already left: {returns(walk.trail)}")
    print("entries by module: " + ", ".join(f"{m} {n}" for m, n in entries.most_common()))
    print(f"call sites outside ending.py that ask for an ending: {len(asked)}")
    for site in asked:
        print(f"  {site}")


if __name__ == "__main__":
    main()
