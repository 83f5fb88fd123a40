"""One test per validation rule, each checking the code and the 1-based line it reports."""

from __future__ import annotations

import json
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


def test_deep_nesting_is_an_error_not_a_crash(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    limits = Limits(**{**LIMITS.__dict__, "max_line_bytes": 1 << 20})
    assert check(tmp_path, [deep], limits) == [("invalid_json_line", 1)]


def test_missing_model_uses_the_served_one(tmp_path):
    assert check(tmp_path, [line("a", body={"messages": []})]) == []
