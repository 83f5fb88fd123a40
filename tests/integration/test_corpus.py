"""The malformed-batch corpus (tests/data/malformed, made by make_corpus.py): each file fails validation with
its expected first error, directly and through the API, and nothing else is lost on the way.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_corpus.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core.config import Settings
from tests.helpers import create_batch, wait_status

CORPUS = Path(__file__).resolve().parents[1] / "data" / "malformed"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text())


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The limits the corpus was made against (tests/unit/test_corpus.py's), and every batch of it active at once."""
    return Settings(
        data_dir=tmp_path / "data",
        max_requests_per_batch=20,
        max_line_bytes=20_000,
        max_choices_per_request=8,
        max_active_batches_per_key=0,
    )


# A file that is empty, or whose first line is no JSON object, is refused at upload (OpenAI's "Must be .jsonl");
# any other problem fails its batch at validation, with the line.
REFUSED_AT_UPLOAD = {
    "empty_file": "empty_file",
    "invalid_json_line": "invalid_file_format",
    "invalid_utf8": "invalid_file_format",
}


def test_every_corpus_file_fails_at_upload_or_its_batch_with_that_error_through_the_api(client, fake_engine):
    batch_ids, refused = {}, set()
    for name in sorted(EXPECTED):
        content = (CORPUS / name).read_bytes()
        response = client.post("/v1/files", files={"file": (name, content)}, data={"purpose": "batch"})
        if response.status_code == 400:
            first_line = next((n for n, line in enumerate(content.splitlines(), 1) if line.strip()), 1)
            expected = EXPECTED[name]
            assert expected["line"] in (None, first_line), name
            assert response.json()["error"]["code"] == REFUSED_AT_UPLOAD.get(expected["code"]), name
            refused.add(name)
            continue
        assert response.status_code == 200, response.text
        batch_ids[name] = create_batch(client, response.json()["id"])["id"]
    assert len(batch_ids) >= 30  # most of the corpus is valid JSONL with a problem inside
    for name, batch_id in batch_ids.items():
        batch = wait_status(client, batch_id, {"failed"})
        first = batch["errors"]["data"][0]
        assert (first["code"], first["line"]) == (EXPECTED[name]["code"], EXPECTED[name]["line"]), name
    assert fake_engine.executor.calls == 0
    listed = client.get("/v1/files", params={"purpose": "batch"}).json()["data"]
    assert {f["filename"] for f in listed} == set(EXPECTED) - refused
    assert client.get("/health").status_code == 200
