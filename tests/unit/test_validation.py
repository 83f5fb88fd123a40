"""One test per validation rule, each checking the code and the 1-based line it reports."""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.domain.validation import Limits, validate_file

LIMITS = Limits(endpoint="/v1/chat/completions", served_models=frozenset({"m"}), max_requests=5, max_line_bytes=400)


def line(custom_id: str = "a", **overrides) -> dict:
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
    request.update(overrides)
    return request


def check(tmp_path: Path, rows: list, limits: Limits = LIMITS) -> list[tuple[str, int | None]]:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    report = validate_file(path, limits)
    return [(e.code, e.line) for e in report.errors]


def test_valid_file_passes_and_reports_model(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps(line("a")) + "\n" + json.dumps(line("b")) + "\n")
    report = validate_file(path, LIMITS)
    assert report.ok and report.total == 2 and report.model == "m"


def test_invalid_json(tmp_path):
    assert check(tmp_path, [line("a"), b"{oops\n"]) == [("invalid_json_line", 2)]


def test_line_not_an_object(tmp_path):
    assert check(tmp_path, [b"[1, 2]\n", b"42\n"]) == [("invalid_json_line", 1), ("invalid_json_line", 2)]


def test_missing_custom_id(tmp_path):
    assert check(tmp_path, [line(custom_id=None)]) == [("missing_custom_id", 1)]


def test_custom_id_must_be_a_string(tmp_path):
    assert check(tmp_path, [line(custom_id=7)]) == [("missing_custom_id", 1)]


def test_method_must_be_post(tmp_path):
    assert check(tmp_path, [line("a"), line("b", method="GET")]) == [("invalid_method", 2)]


def test_url_must_equal_endpoint(tmp_path):
    assert check(tmp_path, [line("a", url="/v1/embeddings")]) == [("mismatched_url", 1)]


def test_body_must_be_an_object(tmp_path):
    assert check(tmp_path, [line("a", body="hi")]) == [("missing_body", 1)]


def test_duplicate_custom_id(tmp_path):
    assert check(tmp_path, [line("a"), line("b"), line("a")]) == [("duplicate_custom_id", 3)]


def test_model_must_be_served(tmp_path):
    assert check(tmp_path, [line("a", body={"model": "gpt-4o"})]) == [("model_not_found", 1)]


def test_one_model_per_file(tmp_path):
    limits = Limits(**{**LIMITS.__dict__, "served_models": frozenset({"m", "n"})})
    rows = [line("a"), line("b", body={"model": "n"})]
    assert check(tmp_path, rows, limits) == [("mismatched_model", 2)]


def test_stream_is_rejected(tmp_path):
    assert check(tmp_path, [line("a", body={"model": "m", "stream": True})]) == [("invalid_value", 1)]


def test_line_size_limit(tmp_path):
    big = line("a", body={"model": "m", "messages": [{"role": "user", "content": "x" * 500}]})
    assert check(tmp_path, [line("z"), big]) == [("line_too_large", 2)]


def test_request_count_limit(tmp_path):
    assert check(tmp_path, [line(str(i)) for i in range(7)]) == [("too_many_requests", 6)]


def test_empty_file(tmp_path):
    assert check(tmp_path, [b"\n", b"  \n"]) == [("empty_file", None)]


def test_blank_lines_and_crlf_and_bom_keep_line_numbers(tmp_path):
    rows = [b"\xef\xbb\xbf" + json.dumps(line("a")).encode() + b"\r\n", b"\n", b"{bad\r\n"]
    assert check(tmp_path, rows) == [("invalid_json_line", 3)]


BIG_LINES = Limits(**{**LIMITS.__dict__, "max_line_bytes": 1 << 20})


def nested_in_body(levels: int, custom_id: str = "a") -> bytes:
    """A request whose body holds `levels` nested arrays: built as bytes, since json.dumps recurses too."""
    head = json.dumps(line(custom_id)).encode()[:-2]  # without the body's and the line's closing braces
    return head + b', "extra": ' + b"[" * levels + b"]" * levels + b"}}\n"


def test_nesting_past_what_python_parses_is_nesting_too_deep_with_its_line(tmp_path):
    rows = [line("z"), nested_in_body(5_000), b"[" * 100_000 + b"]" * 100_000 + b"\n", nested_in_body(100_000, "b")]
    assert check(tmp_path, rows, BIG_LINES) == [
        ("nesting_too_deep", 2),
        ("nesting_too_deep", 3),
        ("nesting_too_deep", 4),
    ]


def test_nesting_is_measured_at_the_limit_and_outside_strings(tmp_path):
    # The line and its body are two levels: 62 more is 64, the limit.
    at_limit, past_limit = nested_in_body(62, "a"), nested_in_body(63, "b")
    brackets_in_text = line("c", body={"model": "m", "messages": [{"role": "user", "content": '[{\\"' * 1000}]})
    assert check(tmp_path, [at_limit, past_limit, brackets_in_text], BIG_LINES) == [("nesting_too_deep", 2)]


def test_an_unclosed_deep_line_is_nesting_too_deep_and_cheap(tmp_path):
    started = time.perf_counter()
    assert check(tmp_path, [b'{"custom_id": "a", "body": ' + b"{" * 500_000 + b"\n"], BIG_LINES) == [
        ("nesting_too_deep", 1)
    ]
    assert time.perf_counter() - started < 2


def test_a_lone_surrogate_anywhere_in_a_line_is_invalid_unicode_with_its_line_and_field(tmp_path):
    rows = [
        line("ok"),
        line("\ud800"),
        line("b", body={"model": "m", "messages": [{"role": "user", "content": "x\udc00"}]}),
        line("c", body={"model": "m", "\udbff": 1}),
        {**line("d"), "\udfff": "x"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    errors = validate_file(path, LIMITS).errors
    assert [(e.code, e.line, e.param) for e in errors] == [
        ("invalid_unicode", 2, "custom_id"),
        ("invalid_unicode", 3, "body"),
        ("invalid_unicode", 4, "body"),
        ("invalid_unicode", 5, None),
    ]
    for error in errors:  # the report itself must be storable and servable as UTF-8
        error.model_dump_json().encode()


def test_paired_surrogates_and_escaped_backslashes_are_text(tmp_path):
    emoji = line("\U0001f600", body={"model": "m", "messages": [{"role": "user", "content": "\U0001f600 caf\u00e9"}]})
    literal_backslash_u = line("\\ud800")  # a backslash, then 'ud800': no surrogate
    assert check(tmp_path, [emoji, literal_backslash_u]) == []


def test_missing_model_uses_the_served_one(tmp_path):
    assert check(tmp_path, [line("a", body={"messages": []})]) == []
