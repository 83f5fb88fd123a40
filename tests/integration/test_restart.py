"""A service stopped mid-batch and started again on the same data directory finishes the batch without
re-running what had finished and without writing any custom_id twice."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from app.core.config import Settings
from app.testing import FakeEngine
from tests.helpers import (
    app_on,
    create_batch,
    jsonl,
    read_jsonl,
    request_line,
    stopped_mid_batch,
    storage_of,
    stored_names,
    upload,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.both_backends


def test_restart_resumes_without_rerunning_finished_lines(settings):
    batch = stopped_mid_batch(settings, lines=20, answered=5).batch
    # The run's part file carries its lease's token: the one run so far wrote the one output part.
    [output_part] = settings.files_dir.glob(f"{batch['id']}.*.output.part")
    first_lines = output_part.read_bytes().splitlines()
    assert len(first_lines) == 5
    # Bytes after the last checkpoint (a whole line, then half of one, as a crash mid-write leaves them) are not
    # counted in SQLite: the restart cuts them off and runs r19 again, so it still ends up exactly once.
    with output_part.open("ab") as torn:
        torn.write(b'{"id":"batch_req_late","custom_id":"r19","response":null,"error":null}\n')
        torn.write(b'{"id":"batch_req_torn","custom_id":"r1')

    sent, done, outputs = finished_on_a_new_engine(settings, batch["id"])
    assert sent == 15
    assert Counter(o["custom_id"] for o in outputs) == Counter(f"r{i}" for i in range(20))
    assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    assert done["usage"]["input_tokens"] == 20 * 5
    # The lines written before the stop are kept as first written (same ids, same created times).
    assert {json.loads(line)["id"] for line in first_lines} <= {o["id"] for o in outputs}


def test_a_resumed_run_stopped_in_its_turn_is_resumed_from_both_runs_checkpoints(settings):
    """Two stops in one batch's life (tests/e2e/test_crash_recovery.py kills the real service once mid-run): the
    third run sends only the lines neither run before it finished, and keeps what both wrote as first written."""
    batch = stopped_mid_batch(settings, lines=20, answered=5).batch
    second_engine = FakeEngine()
    second_engine.executor.answer_first = 5
    with app_on(settings, second_engine) as client:
        wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 10)
    # Each run's part file (named by its lease token) starts with what the run before it had kept.
    parts = settings.files_dir.glob(f"{batch['id']}.*.output.part")
    written = {line["id"]: line for part in parts for line in map(json.loads, part.read_bytes().splitlines())}
    assert len(written) == 10

    sent, _, outputs = finished_on_a_new_engine(settings, batch["id"])
    assert sent == 10
    assert Counter(o["custom_id"] for o in outputs) == Counter(f"r{i}" for i in range(20))
    assert [o for o in outputs if o["id"] in written] == list(written.values())


def finished_on_a_new_engine(settings: Settings, batch_id: str) -> tuple[int, dict, list[dict]]:
    """A restart on `settings` over a fresh fake engine, until the batch completes: the requests it sent the engine,
    the batch, and its output lines."""
    engine = FakeEngine()
    with app_on(settings, engine) as client:
        done = wait_status(client, batch_id, {"completed"})
        outputs = read_jsonl(client, done["output_file_id"])
    return engine.executor.calls, done, outputs


def test_partial_output_shows_checkpointed_lines_while_running(client, fake_engine, settings):
    fake_engine.executor.answer_first = 3
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(6)] + [request_line("bad", max_tokens=-1)]))
    batch = create_batch(client, source["id"])

    def three_lines() -> list[dict] | None:
        response = client.get(f"/v1/batches/{batch['id']}/partial_output")
        assert response.status_code == 200
        lines = [json.loads(line) for line in response.content.splitlines()]
        return lines if len(lines) == 3 else None

    early = three_lines() or wait_for(three_lines)
    fake_engine.executor.gate.set()
    done = wait_status(client, batch["id"], {"completed"})
    final = read_jsonl(client, done["output_file_id"])
    assert early == final[:3]
    after = client.get(f"/v1/batches/{batch['id']}/partial_output").content
    assert after == client.get(f"/v1/files/{done['output_file_id']}/content").content
    errors = client.get(f"/v1/batches/{batch['id']}/partial_output", params={"kind": "error"})
    assert [json.loads(line)["custom_id"] for line in errors.content.splitlines()] == ["bad"]
    assert client.get(f"/v1/batches/{batch['id']}/partial_output", params={"kind": "x"}).status_code == 400
    missing = client.get("/v1/batches/batch_nope/partial_output")
    assert missing.status_code == 404 and missing.json()["error"]["param"] is not None
    # An ended batch whose file was deleted has no lines to show: a 404, not an empty answer.
    assert client.delete(f"/v1/files/{done['output_file_id']}").status_code == 200
    gone = client.get(f"/v1/batches/{batch['id']}/partial_output")
    assert gone.status_code == 404 and done["output_file_id"] in gone.json()["error"]["message"]
    assert client.get(f"/v1/batches/{batch['id']}/partial_output", params={"kind": "error"}).status_code == 200
    assert client.delete(f"/v1/files/{done['error_file_id']}").status_code == 200
    assert client.get(f"/console/batches/{batch['id']}").status_code == 200  # its page shows no error lines, no 404


def test_start_sweeps_what_a_crash_left_and_keeps_the_rest(settings):
    with app_on(settings) as client:
        kept = upload(client, jsonl([request_line("a")]))
    (settings.files_dir / ".file-torn.upload").write_bytes(b"{}\n")
    for name in ["file-neverrecorded", "batch_gone.output.part"]:
        asyncio.run(storage_of(settings).save_bytes(name, b"{}\n"))
    with app_on(settings) as client:
        assert client.get(f"/v1/files/{kept['id']}/content").content == jsonl([request_line("a")])
    assert stored_names(settings) == [kept["id"]]
