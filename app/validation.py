"""Validation of a batch input file, line by line, the way OpenAI reports problems: code, message, 1-based line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.schemas import BatchError

# A file with thousands of bad lines gets a readable report, not a megabyte of errors.
MAX_REPORTED_ERRORS = 100


@dataclass(frozen=True)
class Limits:
    endpoint: str
    served_models: frozenset[str]
    max_requests: int
    max_line_bytes: int


@dataclass
class Report:
    total: int = 0
    model: str | None = None
    errors: list[BatchError] = field(default_factory=list)
    error_count: int = 0

    def add(self, code: str, message: str, *, line: int | None = None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))

    @property
    def ok(self) -> bool:
        return self.error_count == 0


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without the terminator); blank lines are skipped, as OpenAI does."""
    with path.open("rb") as src:
        for number, raw in enumerate(src, start=1):
            line = raw.rstrip(b"\r\n")
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if line.strip():
                yield number, line


def validate_lines(lines: Iterable[tuple[int, bytes]], limits: Limits) -> Report:
    report = Report()
    seen_ids: set[str] = set()
    for number, line in lines:
        report.total += 1
        if report.total > limits.max_requests:
            report.add(
                "too_many_requests",
                f"The input file has more than the maximum of {limits.max_requests} requests.",
                line=number,
            )
            break
        _check_line(number, line, limits, seen_ids, report)
    if report.total == 0:
        report.add("empty_file", "The input file is empty: it holds no requests.")
    return report


def _check_line(number: int, line: bytes, limits: Limits, seen_ids: set[str], report: Report) -> None:
    if len(line) > limits.max_line_bytes:
        report.add("line_too_large", f"This line is larger than {limits.max_line_bytes} bytes.", line=number)
        return
    request = _parse(line)
    if not isinstance(request, dict):
        report.add("invalid_json_line", "This line is not parseable as valid JSON.", line=number)
        return
    problem = _shape_problem(request, limits.endpoint)
    if problem is not None:
        code, message, param = problem
        report.add(code, message, line=number, param=param)
        return
    custom_id = request["custom_id"]
    if custom_id in seen_ids:
        report.add(
            "duplicate_custom_id",
            f"The custom_id '{custom_id}' is used more than once; custom_id must be unique within a batch.",
            line=number,
            param="custom_id",
        )
        return
    seen_ids.add(custom_id)
    _check_model(number, request["body"], limits, report)


def _parse(line: bytes) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _shape_problem(request: dict, endpoint: str) -> tuple[str, str, str] | None:
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "Each line needs a non-empty string 'custom_id'.", "custom_id"
    if request.get("method") != "POST":
        return "invalid_method", "'method' must be 'POST'.", "method"
    url = request.get("url")
    if url != endpoint:
        return "mismatched_url", f"'url' is {url!r}, but this batch's endpoint is '{endpoint}'.", "url"
    body = request.get("body")
    if not isinstance(body, dict):
        return "missing_body", "Each line needs a JSON object 'body' with the endpoint's parameters.", "body"
    if body.get("stream") not in (None, False):
        return "invalid_value", "Streaming is not supported in a batch: remove 'stream'.", "body.stream"
    return None


def _check_model(number: int, body: dict, limits: Limits, report: Report) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str) or model not in limits.served_models:
        report.add(
            "model_not_found",
            f"The model {model!r} is not served here. Served: {', '.join(sorted(limits.served_models))}.",
            line=number,
            param="body.model",
        )
        return
    if report.model is None:
        report.model = model
    elif model != report.model:
        report.add(
            "mismatched_model",
            f"Every line must use the same model: line has '{model}', earlier lines '{report.model}'.",
            line=number,
            param="body.model",
        )


def validate_file(path: Path, limits: Limits) -> Report:
    return validate_lines(numbered_lines(path), limits)


def request_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """The validated requests, parsed again: (line number, request)."""
    for number, line in numbered_lines(path):
        yield number, json.loads(line)
