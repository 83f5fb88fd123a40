"""Validation of a batch input file, line by line, the way OpenAI reports problems: code, message, 1-based line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from itertools import accumulate
from pathlib import Path

from app.core.config import Settings
from app.domain.adapters import Adapter, AdapterProblem
from app.domain.input_index import InputIndex
from app.domain.schemas import BatchError

# A file with thousands of bad lines gets a readable report, not a megabyte of errors.
MAX_REPORTED_ERRORS = 100
# Deeper JSON than any real request; deeper would only test the recursion limits of the code that reads it.
MAX_JSON_DEPTH = 64
REQUEST_FIELDS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class Limits:
    endpoint: str
    served_models: frozenset[str]
    max_requests: int
    max_line_bytes: int
    max_choices: int = 128
    # Each served LoRA adapter's base model: a batch may mix a base model and its adapters (`app.domain.adapters`).
    parents: Mapping[str, str] = field(default_factory=dict)
    # Adapters found by name in `VBATCH_LORA_DIR` (`app.domain.adapters.AdapterFinder`): asked of a name that is
    # not served, once a validation.
    find_adapter: Callable[[str], Adapter | AdapterProblem | None] | None = None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        endpoint: str,
        served_models: Iterable[str],
        parents: Mapping[str, str] | None = None,
        find_adapter: Callable[[str], Adapter | AdapterProblem | None] | None = None,
    ) -> Limits:
        return cls(
            endpoint=endpoint,
            served_models=frozenset(served_models),
            max_requests=settings.max_requests_per_batch,
            max_line_bytes=settings.max_line_bytes,
            max_choices=settings.max_choices_per_request,
            parents=dict(parents or {}),
            find_adapter=find_adapter,
        )

    def base_of(self, model: str) -> str:
        return self.parents.get(model, model)


@dataclass
class Report:
    total: int = 0
    # The batch's model: the one its lines name, or the base model when they mix it and its adapters (OpenAI allows
    # one model a batch; vLLM runs each line on the adapter it names).
    model: str | None = None
    errors: list[BatchError] = field(default_factory=list)
    error_count: int = 0
    # Every valid line; the batch runs from it once the whole file is valid.
    index: InputIndex = field(default_factory=InputIndex)
    # What `Limits.find_adapter` said of each name the lines gave that is not served: asked once a name.
    looked_up: dict[str, Adapter | AdapterProblem | None] = field(default_factory=dict)

    def add(self, code: str, message: str, *, line: int | None = None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    @property
    def found_adapters(self) -> list[Adapter]:
        """The adapters of `VBATCH_LORA_DIR` the lines name."""
        return [found for found in self.looked_up.values() if isinstance(found, Adapter)]

    def base_of(self, model: str, limits: Limits) -> str:
        found = self.looked_up.get(model)
        return found.parent if isinstance(found, Adapter) else limits.base_of(model)

    def adapter_of(self, body: dict, limits: Limits) -> str | None:
        """The LoRA adapter a valid line names, served or found by name (None: the base model)."""
        model = body.get("model")
        if not isinstance(model, str):
            return None
        return model if model in limits.parents or isinstance(self.looked_up.get(model), Adapter) else None


@dataclass(frozen=True)
class RawLine:
    number: int  # 1-based, counting blank lines
    offset: int  # where `data` starts in the file
    data: bytes  # without its terminator (and without a BOM on line 1)


def numbered_lines(path: Path, max_line_bytes: int | None = None) -> Iterator[RawLine]:
    """The file's non-blank lines, in one pass; blank lines are skipped, as OpenAI does.

    With `max_line_bytes`, a longer line comes back cut to one byte over the limit, so that a file of one huge
    line is never held in memory whole.
    """
    cap = -1 if max_line_bytes is None else max_line_bytes + 3  # room for a BOM or CRLF around a full line
    with path.open("rb") as src:
        number = 0
        offset = 0
        while raw := src.readline(cap):
            number += 1
            start = offset
            offset += len(raw)
            if not raw.endswith(b"\n") and len(raw) == cap:
                offset += _skip_rest_of_line(src)
            line = raw.rstrip(b"\r\n")
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line, start = line[3:], start + 3
            if line.strip():
                yield RawLine(number, start, line)


def _skip_rest_of_line(src) -> int:
    skipped = 0
    while rest := src.readline(1 << 20):
        skipped += len(rest)
        if rest.endswith(b"\n"):
            break
    return skipped


def validate_lines(lines: Iterable[RawLine], limits: Limits) -> Report:
    report = Report()
    seen_ids: set[str] = set()
    for line in lines:
        report.total += 1
        if report.total > limits.max_requests:
            report.add(
                "too_many_requests",
                f"The input file has more than the maximum of {limits.max_requests} requests.",
                line=line.number,
            )
            break
        request = _check_line(line.number, line.data, limits, seen_ids, report)
        if request is not None and report.ok:
            report.index.add(
                number=line.number,
                offset=line.offset,
                length=len(line.data),
                custom_id=request["custom_id"],
                body=request["body"],
                adapter=report.adapter_of(request["body"], limits),
            )
    if report.total == 0:
        report.add("empty_file", "The input file is empty: it holds no requests.")
    return report


def _check_line(number: int, line: bytes, limits: Limits, seen_ids: set[str], report: Report) -> dict | None:
    """The request on the line, or None (with the problem in `report`)."""
    if len(line) > limits.max_line_bytes:
        report.add("line_too_large", f"This line is larger than {limits.max_line_bytes} bytes.", line=number)
        return None
    request = _parse(line)
    problem = _syntax_problem(request, line) or _shape_problem(request, limits)
    if problem is not None:
        code, message, param = problem
        report.add(code, message, line=number, param=param)
        return None
    assert isinstance(request, dict)
    custom_id = request["custom_id"]
    if custom_id in seen_ids:
        report.add(
            "duplicate_custom_id",
            f"The custom_id {_show(custom_id)} is used more than once; custom_id must be unique within a batch.",
            line=number,
            param="custom_id",
        )
        return None
    seen_ids.add(custom_id)
    return request if _model_ok(number, request["body"], limits, report) else None


class _Unparsed(Enum):
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    TOO_DEEP = "too_deep"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _parse(line: bytes) -> object:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return _Unparsed.NOT_UTF8
    # Measured on the bytes, before parsing: Python's parser recurses once a level and gives up near 1,000 levels
    # with a RecursionError that says nothing of why.
    if _may_nest_too_deep(line) and _nesting_depth(line) > MAX_JSON_DEPTH:
        return _Unparsed.TOO_DEEP
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # the scan bounds what the parser sees; this only guards a stack already nearly spent
        return _Unparsed.TOO_DEEP
    except ValueError:
        return _Unparsed.NOT_JSON


def _may_nest_too_deep(line: bytes) -> bool:
    """Each level of nesting opens a bracket: a line with few (every real request) needs no scan."""
    return line.count(b"{") + line.count(b"[") > MAX_JSON_DEPTH


# Opening brackets become 1 and closing ones -1 (as signed bytes); every other byte is dropped.
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[{]}"))


def _nesting_depth(line: bytes) -> int:
    """The deepest nesting of brackets outside strings, in a few linear passes over the bytes (nothing recursive,
    nothing that backtracks). Escaped backslashes go first, then escaped quotes; every other run between the quotes
    left is a string."""
    unescaped = line.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    steps = memoryview(outside_strings.translate(_BRACKET_STEPS, _NOT_BRACKETS)).cast("b")
    return max(accumulate(steps), default=0)


# Only a \uD800-\uDFFF escape can put a surrogate in a parsed string (a valid pair becomes one character, and
# UTF-8 bytes never decode to one): a line without such an escape is not searched.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _lone_surrogate_field(request: dict, line: bytes) -> str | None:
    """The top-level field whose name or value (any string in it, keys included) holds a lone surrogate, or None."""
    if not _SURROGATE_ESCAPE.search(line):
        return None
    return next((name for name, value in request.items() if _holds_lone_surrogate([name, value])), None)


def _holds_lone_surrogate(value: object) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


Problem = tuple[str, str, str | None]


def _syntax_problem(request: object, line: bytes) -> Problem | None:
    if request is _Unparsed.NOT_UTF8:
        return "invalid_utf8", "This line is not valid UTF-8 text.", None
    if request is _Unparsed.TOO_DEEP:
        return "nesting_too_deep", f"This line nests JSON deeper than {MAX_JSON_DEPTH} levels.", None
    if request is _Unparsed.NOT_JSON:
        return "invalid_json_line", "This line is not parseable as valid JSON.", None
    if not isinstance(request, dict):
        return "invalid_json_line", "Each line must be a JSON object (a request), not another JSON value.", None
    # Before any check that quotes the line's text: a lone surrogate has no UTF-8 form, in an error message or a
    # result line.
    surrogate_field = _lone_surrogate_field(request, line)
    if surrogate_field is not None:
        param = surrogate_field if surrogate_field in REQUEST_FIELDS else None
        where = f"'{param}'" if param else "A field"
        message = f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape): that is not Unicode text."
        return "invalid_unicode", message, param
    unknown = sorted(set(request) - set(REQUEST_FIELDS))
    if unknown:
        return "unknown_parameter", f"Unknown field '{unknown[0]}': a line has only {_fields()}.", unknown[0]
    return None


def _fields() -> str:
    return ", ".join(f"'{name}'" for name in REQUEST_FIELDS)


def _shape_problem(request: object, limits: Limits) -> Problem | None:
    assert isinstance(request, dict)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "Each line needs a non-empty string 'custom_id'.", "custom_id"
    if request.get("method") != "POST":
        return "invalid_method", "'method' must be 'POST'.", "method"
    url = request.get("url")
    if url != limits.endpoint:
        return "mismatched_url", f"'url' is {_show(url)}, but this batch's endpoint is '{limits.endpoint}'.", "url"
    body = request.get("body")
    if not isinstance(body, dict):
        return "missing_body", "Each line needs a JSON object 'body' with the endpoint's parameters.", "body"
    if body.get("stream") not in (None, False):
        return "invalid_value", "Streaming is not supported in a batch: remove 'stream'.", "body.stream"
    return _choices_problem(body.get("n"), limits.max_choices)


def _choices_problem(n: object, max_choices: int) -> Problem | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_choices:
        return "invalid_value", f"'n' must be an integer from 1 to {max_choices}; it is {_show(n)}.", "body.n"
    return None


def _show(value: object) -> str:
    """A value for an error message, cut short: it may be anything the file held."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _model_ok(number: int, body: dict, limits: Limits, report: Report) -> bool:
    model = body.get("model")
    if model is None:
        return True
    if not isinstance(model, str) or (model not in limits.served_models and not _found(model, limits, report)):
        report.add(
            "model_not_found",
            f"The model {_show(model)} is not served here. Served: {', '.join(sorted(limits.served_models))}.",
            line=number,
            param="body.model",
        )
        return False
    found = report.looked_up.get(model)
    if isinstance(found, AdapterProblem):
        report.add(found.code, found.message, line=number, param="body.model")
        return False
    if report.model is None:
        report.model = model
    elif report.base_of(model, limits) != report.base_of(report.model, limits):
        report.add(
            "mismatched_model",
            f"Every line must use the same model, or it and its LoRA adapters: line has {_show(model)}, earlier "
            f"lines {_show(report.model)}.",
            line=number,
            param="body.model",
        )
        return False
    elif model != report.model:
        report.model = report.base_of(model, limits)
    return True


def _found(model: str, limits: Limits, report: Report) -> bool:
    """Whether `VBATCH_LORA_DIR` has a folder by this name (an adapter, or why it cannot be one)."""
    if limits.find_adapter is None:
        return False
    if model not in report.looked_up:
        report.looked_up[model] = limits.find_adapter(model)
    return report.looked_up[model] is not None


def validate_file(path: Path, limits: Limits) -> Report:
    """The file's one full read: every line checked, and the index of the valid ones built as it goes."""
    return validate_lines(numbered_lines(path, limits.max_line_bytes), limits)
