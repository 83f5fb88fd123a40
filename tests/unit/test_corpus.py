"""The malformed-batch corpus (tests/data/malformed, made by make_corpus.py): each file fails validation with
its expected first error, directly and through the API, and nothing else is lost on the way.

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_corpus.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.domain.validation import Limits, validate_file

CORPUS = Path(__file__).resolve().parents[1] / "data" / "malformed"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text())
LIMITS = Limits(
    endpoint="/v1/chat/completions",
    served_models=frozenset({"fake-model"}),
    max_requests=20,
    max_line_bytes=20_000,
    max_choices=8,
)


def test_the_corpus_is_big_enough_and_complete():
    assert len(EXPECTED) >= 40
    assert sorted(EXPECTED) == sorted(p.name for p in CORPUS.glob("*.jsonl"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_validator_reports_the_expected_first_error(name):
    report = validate_file(CORPUS / name, LIMITS)
    first = report.errors[0]
    assert (first.code, first.line) == (EXPECTED[name]["code"], EXPECTED[name]["line"]), first.message
