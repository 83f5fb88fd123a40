"""Property tests: whatever bytes or JSON a batch file holds, the validator returns a report (it never raises),
and every error it reports points at a real, non-blank line of that file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.domain.validation import Limits, validate_file

LIMITS = Limits(
    endpoint="/v1/chat/completions",
    served_models=frozenset({"m"}),
    max_requests=50,
    max_line_bytes=2_000,
    max_choices=8,
)
FILE_LEVEL_CODES = {"empty_file"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
# Lines shaped like requests, with each part sometimes right and sometimes anything at all.
request_like = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": st.text(max_size=8) | json_values,
        "method": st.sampled_from(["POST", "GET", "post"]) | json_values,
        "url": st.sampled_from(["/v1/chat/completions", "/v1/completions"]) | json_values,
        "body": st.fixed_dictionaries(
            {},
            optional={
                "model": st.sampled_from(["m", "other"]) | json_values,
                "messages": json_values,
                "stream": json_values,
                "n": st.integers(-3, 300) | json_values,
            },
        )
        | json_values,
        "extra": json_values,
    },
)


def _validate(content: bytes):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "input.jsonl"
        path.write_bytes(content)
        return validate_file(path, LIMITS)


def _assert_errors_name_real_lines(content: bytes) -> None:
    report = _validate(content)
    physical = content.split(b"\n")
    for error in report.errors:
        if error.line is None:
            assert error.code in FILE_LEVEL_CODES
            continue
        assert 1 <= error.line <= len(physical), error
        named = physical[error.line - 1]
        if error.line == 1:
            named = named.removeprefix(b"\xef\xbb\xbf")
        assert named.strip(), error
    assert report.ok == (report.error_count == 0) and len(report.errors) <= report.error_count


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=3_000))
def test_arbitrary_bytes_never_raise_and_errors_name_real_lines(content):
    _assert_errors_name_real_lines(content)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(json_values | request_like, max_size=12), st.sampled_from([b"\n", b"\r\n", b"\n\n"]))
def test_arbitrary_json_lines_never_raise_and_errors_name_real_lines(values, separator):
    content = separator.join(json.dumps(v).encode() for v in values)
    _assert_errors_name_real_lines(content)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), min_size=1, max_size=10, unique=True))
def test_valid_requests_pass_whatever_their_text(custom_ids):
    requests = [
        {"custom_id": c or "empty", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
        for c in dict.fromkeys(c or "empty" for c in custom_ids)
    ]
    report = _validate(b"\n".join(json.dumps(r, ensure_ascii=False).encode() for r in requests))
    assert report.ok and report.total == len(requests)
