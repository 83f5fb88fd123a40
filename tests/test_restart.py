"""A service stopped mid-batch and started again on the same data directory finishes the batch without
re-running what had finished and without writing any custom_id twice."""

from __future__ import annotations

import json
from collections import Counter

from fastapi.testclient import TestClient

from app.engine.runner import part_names
from app.main import create_app
from tests.fakes import FakeEngineService
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status


def test_restart_resumes_without_rerunning_finished_lines(settings):
    first_engine = FakeEngineService()
    first_engine.executor.answer_first = 5
    with TestClient(create_app(settings, first_engine)) as client:
        source = upload(client, jsonl([request_line(f"r{i}") for i in range(20)]))
        batch = create_batch(client, source["id"])
        wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 5)
    output_part = settings.files_dir / part_names(batch["id"])[0]
    first_lines = output_part.read_bytes().splitlines()
    assert len(first_lines) == 5
    # A crash mid-write leaves half a line behind; the restart must cut it off.
    with output_part.open("ab") as torn:
        torn.write(b'{"id":"batch_req_torn","custom_id":"r1')

    second_engine = FakeEngineService()
    with TestClient(create_app(settings, second_engine)) as client:
        done = wait_status(client, batch["id"], {"completed"})
        outputs = read_jsonl(client, done["output_file_id"])
    assert second_engine.executor.calls == 15
    assert Counter(o["custom_id"] for o in outputs) == Counter(f"r{i}" for i in range(20))
    assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    assert done["usage"]["input_tokens"] == 20 * 5
    # The lines written before the stop are kept as first written (same ids, same created times).
    assert {json.loads(line)["id"] for line in first_lines} <= {o["id"] for o in outputs}
