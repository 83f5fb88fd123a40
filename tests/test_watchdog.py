"""The watchdog property: every batch reaches a final state by the end of its completion window plus a bounded
grace, whatever happens to its engine or its files. (A full disk ends it at once: `test_disk_full.py`; a deleted
input and a late cancel: `test_batch_endings.py`.)"""

from __future__ import annotations

import asyncio
import time

from fastapi.testclient import TestClient

from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine
from tests.helpers import (
    create_batch,
    jsonl,
    read_jsonl,
    request_line,
    storage_of,
    stored_names,
    upload,
    wait_for,
    wait_status,
)

BACKENDS = ("sqlite", "postgres_s3")

FINAL = {"completed", "failed", "cancelled", "expired"}
GRACE = 1.0


def test_a_batch_whose_engine_is_gone_for_good_still_ends_when_its_window_does(settings):
    settings.watchdog_grace_seconds = GRACE
    engine = FakeEngine()
    engine.fail_restarts = True
    with TestClient(create_app(settings, EngineService(engine))) as client:
        lines = [request_line(f"r{i}") for i in range(4)] + [request_line("poison", seed=1)]
        batch = create_batch(client, upload(client, jsonl(lines))["id"], completion_window="2s")
        wait_for(lambda: client.get("/health").json()["status"] == "down")
        assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
        ended = wait_status(client, batch["id"], FINAL, timeout=2 + GRACE + 10)
        assert time.time() <= batch["expires_at"] + GRACE + 5
    assert ended["status"] == "expired" and ended["expired_at"] is not None
    assert ended["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    with TestClient(create_app(settings, EngineService(FakeEngine()))) as client:
        outputs = read_jsonl(client, ended["output_file_id"])
        [error] = read_jsonl(client, ended["error_file_id"])
    assert sorted(o["custom_id"] for o in outputs) == [f"r{i}" for i in range(4)]
    assert error["custom_id"] == "poison" and error["error"]["code"] == "batch_expired"


def test_a_batch_whose_run_keeps_failing_is_ended_with_what_its_checkpoint_holds(settings):
    settings.watchdog_grace_seconds = GRACE
    held = FakeEngine()
    held.executor.answer_first = 2
    with TestClient(create_app(settings, EngineService(held))) as client:
        source = upload(client, jsonl([request_line(f"r{i}") for i in range(6)]))
        batch = create_batch(client, source["id"], completion_window="2s")
        wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 2)
    # Its index torn (a bad disk, an operator's mistake): every run of it from now on raises.
    asyncio.run(storage_of(settings).save_bytes(f"{batch['id']}.index", b"\x00garbage"))
    with TestClient(create_app(settings, EngineService(FakeEngine()))) as client:
        ended = wait_status(client, batch["id"], FINAL, timeout=2 + GRACE + 10)
        assert ended["status"] == "expired"
        assert ended["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
        assert len(read_jsonl(client, ended["output_file_id"])) == 2
        assert client.get("/health").status_code == 200
    assert not [name for name in stored_names(settings) if name.startswith(batch["id"])]
