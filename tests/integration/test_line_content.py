"""Whatever an input line holds, its batch ends. JSON can spell text that is not Unicode (a lone surrogate,
`"\\ud800"`): validation refuses such a line, naming it; and a result writer handed one anyway (from an input
validated before, or any other way past validation) writes it as valid UTF-8 JSONL instead of raising, which left
its batch `in_progress` (or `cancelling`) for ever."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from app.domain import validation
from app.domain.results import error_outcome, http_outcome
from app.engine.batch.parts import ResultSink
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

SURROGATE_ID = "\ud800"
IDS = ["r0", "r1", "r2", "r3", "r4", SURROGATE_ID]


def surrogate_file() -> bytes:
    """Six requests, the last with a lone surrogate for custom_id (json.dumps writes it as the escape `\\ud800`)."""
    return jsonl([request_line(custom_id) for custom_id in IDS])


def let_surrogates_past_validation(monkeypatch) -> None:
    # raising=False: on code without the check this changes nothing, and the line passes validation as it did.
    monkeypatch.setattr(validation, "_lone_surrogate_field", lambda request, line: None, raising=False)


def utf8_jsonl(content: bytes) -> list[dict]:
    """Strictly: every byte valid UTF-8, every line one JSON object."""
    return [json.loads(line) for line in content.decode("utf-8").splitlines()]


def test_a_lone_surrogate_fails_validation_naming_its_line_and_field(client, fake_engine):
    source = upload(client, surrogate_file())
    batch = wait_status(client, create_batch(client, source["id"])["id"], {"failed"}, timeout=10)
    [error] = batch["errors"]["data"]
    assert (error["code"], error["line"], error["param"]) == ("invalid_unicode", 6, "custom_id")
    assert "surrogate" in error["message"]
    assert fake_engine.executor.calls == 0
    assert client.get("/health").json()["status"] == "ok"


def test_a_surrogate_line_past_validation_completes_with_valid_utf8_results(client, monkeypatch):
    let_surrogates_past_validation(monkeypatch)
    source = upload(client, surrogate_file())
    batch = wait_status(client, create_batch(client, source["id"])["id"], {"completed", "failed"}, timeout=10)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    content = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    assert sorted(record["custom_id"] for record in utf8_jsonl(content)) == sorted(IDS)
    assert b'"custom_id":"\\ud800"' in content  # the same JSON value, as an escape


def test_a_cancel_of_a_surrogate_line_past_validation_ends_cancelled(client, fake_engine, monkeypatch):
    let_surrogates_past_validation(monkeypatch)
    fake_engine.executor.answer_first = 2  # the others, the surrogate's among them, wait in flight for the cancel
    batch = create_batch(client, upload(client, surrogate_file())["id"])
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 2)
    assert client.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
    ended = wait_status(client, batch["id"], {"cancelled"}, timeout=10)
    assert ended["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    errors = utf8_jsonl(client.get(f"/v1/files/{ended['error_file_id']}/content").content)
    assert SURROGATE_ID in {record["custom_id"] for record in errors}
    assert len(read_jsonl(client, ended["output_file_id"])) == 2


def test_the_result_writer_writes_any_line_as_valid_utf8_jsonl(tmp_path: Path):
    async def write() -> None:
        sink = ResultSink(tmp_path / "out.part", tmp_path / "err.part")
        await sink.open(output_bytes=None, error_bytes=None, position_of=dict)
        sink.record(0, http_outcome(SURROGATE_ID, 200, {"text": "caf\u00e9 \udc00", "\udfff": 1, "usage": {}}))
        sink.record(1, error_outcome("\udbff\u00e9", "batch_cancelled", "cancelled \ud800"))
        await sink.checkpoint()
        await sink.close()

    asyncio.run(write())
    [output] = utf8_jsonl((tmp_path / "out.part").read_bytes())
    [error] = utf8_jsonl((tmp_path / "err.part").read_bytes())
    assert output["custom_id"] == SURROGATE_ID
    assert output["response"]["body"] == {"text": "caf\u00e9 \udc00", "\udfff": 1, "usage": {}}
    assert (error["custom_id"], error["error"]["message"]) == ("\udbff\u00e9", "cancelled \ud800")

    async def resume() -> set[int]:  # as after a restart: the lines written are read back as done
        sink = ResultSink(tmp_path / "out.part", tmp_path / "err.part")
        await sink.open(output_bytes=None, error_bytes=None, position_of=lambda: {SURROGATE_ID: 0, "\udbff\u00e9": 1})
        await sink.close()
        return sink.done

    assert asyncio.run(resume()) == {0, 1}
