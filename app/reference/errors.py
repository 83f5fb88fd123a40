"""Every error code vbatch sends, found in the source where it is raised: an HTTP answer's `error.code`, a failed
batch's `errors.data[].code` (with its line), a result line's `error.code` in an error file. Read with `ast`, so
that a code written anywhere in `app/` in one of the shapes below is listed with its message, without a list kept by
hand:

- `code="..."` passed to any call (`APIError`, `bad_request`, a domain error, `BatchError`, `RateLimited`, ...);
- a code followed by its message in a call's arguments or a tuple (`report.add("empty_file", "The input ...")`,
  `return "invalid_utf8", "This line ...", None`, `AdapterProblem("invalid_adapter", f"...")`);
- a constant named `*_CODE`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import app
from app.reference.markdown import cell, code, generated, table

CODE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
# An f-string's expression shown as a placeholder: f"{what}_file_not_found" -> "<what>_file_not_found".
_PLACEHOLDER = "<{}>"


@dataclass(frozen=True)
class Raised:
    code: str
    message: str  # as written; an f-string's expressions as {name}
    status: int | None  # where the call names it (APIError(404, ...); bad_request: 400)
    module: str  # app/..., relative to the repository


# What no client is sent: these pages' own code, and the fakes of tests.
_NOT_SENT = ("reference", "testing.py")
# Calls whose arguments name a metric and its help, not a code and its message.
_METRIC_CALLS = ("Counter", "Gauge", "Histogram", "Summary", "CounterMetricFamily", "GaugeMetricFamily")


class _Module:
    """One module's source, with its top-level string constants and those of every other module (a message kept in
    a constant is shown; names are the modules' own, so one defined in two modules is taken from this one)."""

    def __init__(self, tree: ast.Module, shared: dict[str, str] | None = None) -> None:
        self.constants: dict[str, str] = dict(shared or {})
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                text = self.text(node.value)
                if text is not None:
                    self.constants[node.targets[0].id] = text

    def text(self, node: ast.expr | None) -> str | None:
        """A string constant, f-string (its expressions as {name}) or this module's string constant by name."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(_piece(part) for part in node.values)
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.text(node.left), self.text(node.right)
            return None if left is None or right is None else left + right
        return None

    def code(self, node: ast.expr | None) -> str | None:
        """A literal that reads as a code (an f-string's expressions shown as <name>)."""
        if not isinstance(node, ast.Constant | ast.JoinedStr):
            return None
        text = self.text(node) or ""
        shown = re.sub(r"\{([^}]*)\}", lambda m: _PLACEHOLDER.format(m.group(1)), text)
        return shown if CODE.match(re.sub(r"<[^>]*>", "x", shown)) else None

    def message(self, node: ast.expr | None) -> str | None:
        """A text that reads as a message: words, not a name."""
        text = self.text(node)
        return text if text is not None and " " in text.strip() else None


def _piece(part: ast.expr) -> str:
    """One part of an f-string: its text, or its expression as {expression}."""
    if isinstance(part, ast.FormattedValue):
        return "{" + ast.unparse(part.value) + "}"
    return str(part.value) if isinstance(part, ast.Constant) else ""


def _callee(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")


def _status(call: ast.Call) -> int | None:
    if _callee(call) == "bad_request":
        return 400
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Constant) and isinstance(first.value, int) and not isinstance(first.value, bool):
        return first.value
    return None


def _pairs(module: _Module, values: list[ast.expr], *, named: bool = False) -> Iterator[tuple[str, str]]:
    """A code followed by its message among `values`; `named`: the message may be a variable named for one
    (`return "invalid_unicode", message, param`), not known here."""
    for index, value in enumerate(values[:-1]):
        found, after = module.code(value), values[index + 1]
        message = module.message(after)
        if found and message is None and named and isinstance(after, ast.Name) and "message" in after.id.lower():
            message = ""
        if found and message is not None:
            yield found, message


def _in_call(module: _Module, call: ast.Call) -> Iterator[tuple[str, str, int | None]]:
    if _callee(call) in _METRIC_CALLS:
        return
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if found := module.code(keywords.get("code")):
        texts = [text for arg in call.args if (text := module.message(arg)) is not None]
        message = module.message(keywords.get("message"))
        yield found, message or (texts[0] if texts else ""), _status(call)
    for found, message in _pairs(module, call.args):
        yield found, message, _status(call)


def _found(module: _Module, node: ast.AST) -> Iterator[tuple[str, str, int | None]]:
    if isinstance(node, ast.Call):
        yield from _in_call(module, node)
    elif isinstance(node, ast.Return | ast.Assign) and isinstance(node.value, ast.Tuple):
        yield from ((code, message, None) for code, message in _pairs(module, node.value.elts, named=True))
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id.endswith("_CODE") and (found := module.code(node.value)):
                yield found, "", None


def raised_in(path: Path, root: Path, shared: dict[str, str] | None = None) -> Iterator[Raised]:
    tree = ast.parse(path.read_text(), str(path))
    module = _Module(tree, shared)
    for node in ast.walk(tree):
        for code_, message, status in _found(module, node):
            yield Raised(code_, message, status, str(path.relative_to(root)))


def documented(package: Path | None = None) -> dict[str, list[Raised]]:
    """code -> every place it is raised, codes in alphabetical order."""
    package = package or Path(app.__file__).parent
    paths = [path for path in sorted(package.rglob("*.py")) if path.relative_to(package).parts[0] not in _NOT_SENT]
    shared: dict[str, str] = {}
    for path in paths:
        shared.update(_Module(ast.parse(path.read_text(), str(path))).constants)
    found: dict[str, list[Raised]] = {}
    for path in paths:
        for raised in raised_in(path, package.parent, shared):
            places = found.setdefault(raised.code, [])
            if raised not in places:
                places.append(raised)
    return dict(sorted(found.items()))


def _row(name: str, places: list[Raised]) -> tuple[str, ...]:
    statuses = sorted({place.status for place in places if place.status is not None})
    messages = list(dict.fromkeys(place.message for place in places if place.message))
    modules = sorted({place.module for place in places})
    return (
        code(name),
        ", ".join(str(status) for status in statuses),
        "<br>".join(cell(message) for message in messages[:4]),
        "<br>".join(code(module) for module in modules),
    )


def page() -> str:
    rows = [_row(name, places) for name, places in documented().items()]
    return (
        "# Error codes\n\n"
        + generated("the `app/` source, where each code is raised")
        + INTRO
        + table(("code", "HTTP status", "message (as written in the code)", "raised in"), rows)
    )


INTRO = """Every error vbatch sends carries one of the codes below, in one of three places:

- **An HTTP answer** that is not a 2xx: OpenAI's envelope, `{"error": {"message", "type", "param", "code"}}`, with
  `param` naming the parameter at fault where there is one. 400 for a bad request (never 422), 401 for a missing or
  unknown key, 404 for an unknown id or one of another key, 405 for a method the path does not answer, 409 for an
  object not in a state that allows it, 413 for a body or upload past its limit, 429 for a limit of the key's
  (`retry-after`; `x-should-retry: false` where only waiting for the key's own batches helps), 503 for a database
  or engine that cannot take the request now (`retry-after`), 507 for a full disk.
- **A failed batch's `errors.data`**: each problem of an input file with its 1-based `line` (validation does not
  stop at the first: every problem of the file is listed), or the reason a batch could not run or end.
- **A result line's `error`** in a batch's error file: `{"custom_id", "response": null, "error": {"code",
  "message"}}` for a request that never got an answer (cancelled, expired, its engine crashed on it).

What the engine refuses, answering an online request (`/v1/chat/completions`, ...) or a batch line (its error
body), is in OpenAI's words too: vLLM's `"type": "BadRequestError"` and `"code": 400` become `invalid_request_error`
(`server_error` for a 5xx) and the codes below, `param` naming the request's argument; vLLM's message is kept. A
message shows its variable parts as `{name}`; a status is shown where the code that raises it names it, and
otherwise follows the error's kind above.

"""
