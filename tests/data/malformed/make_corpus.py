"""Writes the malformed-batch corpus beside this file, with expected.json: for each file, the first error's
code and line (None for a file-level error). Run once; the files are committed. Limits the corpus assumes:
model "fake-model", at most 20 requests, lines up to 20,000 bytes, n up to 8 (tests/integration/test_corpus.py)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
URL = "/v1/chat/completions"


def good(custom_id: str = "ok", **body) -> dict:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": body}


def line(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def without(key: str) -> dict:
    return {k: v for k, v in good("x").items() if k != key}


G = line(good("first"))
CASES: dict[str, tuple[bytes, str, int | None]] = {
    "empty": (b"", "empty_file", None),
    "only_blank_lines": (b"\n\n   \n\t\n", "empty_file", None),
    "not_json": (b"hello world\n", "invalid_json_line", 1),
    "truncated_json": (G + b'\n{"custom_id": "x", "method": "POST"\n', "invalid_json_line", 2),
    "array_line": (b"[1, 2, 3]\n", "invalid_json_line", 1),
    "string_line": (b'"a request"\n', "invalid_json_line", 1),
    "number_line": (b"42\n", "invalid_json_line", 1),
    "null_line": (b"null\n", "invalid_json_line", 1),
    "invalid_utf8": (G + b'\n{"custom_id": "\xff\xfe", "method": "POST"}\n', "invalid_utf8", 2),
    "latin1_text": (json.dumps(good("caf\u00e9"), ensure_ascii=False).encode("latin-1") + b"\n", "invalid_utf8", 1),
    "utf16_file": ((G.decode() + "\n").encode("utf-16"), "invalid_utf8", 1),
    # JSON's \u escapes can spell a lone surrogate, which no UTF-8 text holds: the line is valid UTF-8, its text is not.
    "lone_surrogate_custom_id": (G + b"\n" + line(good("\ud800")) + b"\n", "invalid_unicode", 2),
    "lone_surrogate_in_body": (line(good("x", user="a\udc00b")) + b"\n", "invalid_unicode", 1),
    "lone_surrogate_key": (line(good("x", **{"\udfff": 1})) + b"\n", "invalid_unicode", 1),
    "nan_value": (G + b"\n" + line(good("x"))[:-2] + b', "temperature": NaN}}\n', "invalid_json_line", 2),
    "infinity_value": (line(good("x"))[:-2] + b', "max_tokens": Infinity}}\n', "invalid_json_line", 1),
    "huge_integer": (line(good("x"))[:-2] + b', "max_tokens": 1' + b"0" * 5000 + b"}}\n", "invalid_json_line", 1),
    "deep_nesting": (line(good("x", extra=json.loads("[" * 100 + "]" * 100))) + b"\n", "nesting_too_deep", 1),
    "recursion_bomb": (b"[" * 6000 + b"]" * 6000 + b"\n", "nesting_too_deep", 1),
    "deep_nesting_5000": (
        line(good("x"))[:-2] + b', "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}}\n",
        "nesting_too_deep",
        1,
    ),
    "deep_nesting_unclosed": (G + b"\n" + b'{"custom_id": "x", "body": ' + b"{" * 5000 + b"\n", "nesting_too_deep", 2),
    "brackets_in_strings": (
        line(good("x", model="gpt-4o", padding="[{" * 5000 + '\\"[')) + b"\n",
        "model_not_found",
        1,
    ),
    "missing_custom_id": (line(without("custom_id")) + b"\n", "missing_custom_id", 1),
    "empty_custom_id": (line({**good(), "custom_id": ""}) + b"\n", "missing_custom_id", 1),
    "numeric_custom_id": (line({**good(), "custom_id": 7}) + b"\n", "missing_custom_id", 1),
    "null_custom_id": (line({**good(), "custom_id": None}) + b"\n", "missing_custom_id", 1),
    "duplicate_custom_id": (G + b"\n" + line(good("second")) + b"\n" + G + b"\n", "duplicate_custom_id", 3),
    "method_get": (line({**good(), "method": "GET"}) + b"\n", "invalid_method", 1),
    "method_lowercase": (line({**good(), "method": "post"}) + b"\n", "invalid_method", 1),
    "missing_method": (line(without("method")) + b"\n", "invalid_method", 1),
    "wrong_url": (line({**good(), "url": "/v1/completions"}) + b"\n", "mismatched_url", 1),
    "missing_url": (line(without("url")) + b"\n", "mismatched_url", 1),
    "url_with_query": (line({**good(), "url": URL + "?x=1"}) + b"\n", "mismatched_url", 1),
    "missing_body": (line(without("body")) + b"\n", "missing_body", 1),
    "string_body": (line({**good(), "body": "hi"}) + b"\n", "missing_body", 1),
    "array_body": (line({**good(), "body": [1]}) + b"\n", "missing_body", 1),
    "stream_true": (G + b"\n" + line(good("s", stream=True)) + b"\n", "invalid_value", 2),
    "stream_string": (line(good("s", stream="yes")) + b"\n", "invalid_value", 1),
    "n_too_large": (line(good("n", n=1000)) + b"\n", "invalid_value", 1),
    "n_zero": (line(good("n", n=0)) + b"\n", "invalid_value", 1),
    "n_string": (line(good("n", n="3")) + b"\n", "invalid_value", 1),
    "n_bool": (line(good("n", n=True)) + b"\n", "invalid_value", 1),
    "unknown_top_level_field": (line({**good(), "metadata": {"a": "b"}}) + b"\n", "unknown_parameter", 1),
    "misspelt_body": (line({**without("body"), "boby": good()["body"]}) + b"\n", "unknown_parameter", 1),
    "unknown_model": (line(good("m", model="gpt-4o")) + b"\n", "model_not_found", 1),
    "numeric_model": (line(good("m", model=5)) + b"\n", "model_not_found", 1),
    "line_too_large": (G + b"\n" + line(good("big", padding="x" * 25_000)) + b"\n", "line_too_large", 2),
    "too_many_requests": (b"".join(line(good(f"r{i}")) + b"\n" for i in range(21)), "too_many_requests", 21),
    "bom_then_garbage": (b"\xef\xbb\xbfnot json\n", "invalid_json_line", 1),
    "crlf_then_bad": (G + b"\r\n{bad\r\n", "invalid_json_line", 2),
    "blank_lines_then_bad": (b"\n\n" + G + b"\n\n" + b"oops\n", "invalid_json_line", 5),
    "nul_bytes": (b"\x00\x00\x00\n", "invalid_json_line", 1),
    "trailing_garbage": (G + b" extra\n", "invalid_json_line", 1),
    "two_objects_one_line": (G + b" " + line(good("second")) + b"\n", "invalid_json_line", 1),
    "lone_cr_separators": (G + b"\r" + line(good("second")) + b"\n", "invalid_json_line", 1),
    "good_then_bad_last_line_no_newline": (G + b"\n" + b'{"custom_id": 1', "invalid_json_line", 2),
}


def main() -> None:
    expected = {}
    for name, (content, code, number) in CASES.items():
        (HERE / f"{name}.jsonl").write_bytes(content)
        expected[f"{name}.jsonl"] = {"code": code, "line": number}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
