"""The watchdog property: every batch reaches a final state by the end of its completion window plus a bounded
grace, whatever happens to its engine or its files. (A full disk ends it at once: `test_disk_full.py`; a deleted
input and a late cancel: `test_batch_endings.py`.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from app.core import failpoints
from app.core.failpoints import Failpoints
from app.testing import FakeEngine
from tests.helpers import (
    FINAL,
    app_on,
    create_batch,
    held_batch,
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

GRACE = 1.0


def test_a_batch_whose_engine_is_gone_for_good_still_ends_when_its_window_does(settings):
    settings.watchdog_grace_seconds = GRACE
    engine = FakeEngine()
    engine.fail_restarts = True
    with app_on(settings, engine) as client:
        lines = [request_line(f"r{i}") for i in range(4)] + [request_line("poison", seed=1)]
        batch = create_batch(client, upload(client, jsonl(lines))["id"], completion_window="2s")
        wait_for(lambda: client.get("/health").json()["status"] == "down")
        assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
        ended = wait_status(client, batch["id"], FINAL, timeout=2 + GRACE + 10)
        assert time.time() <= batch["expires_at"] + GRACE + 5
    assert ended["status"] == "expired" and ended["expired_at"] is not None
    assert ended["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    with app_on(settings) as client:
        outputs = read_jsonl(client, ended["output_file_id"])
        [error] = read_jsonl(client, ended["error_file_id"])
    assert sorted(o["custom_id"] for o in outputs) == [f"r{i}" for i in range(4)]
    assert error["custom_id"] == "poison" and error["error"]["code"] == "batch_expired"


def test_a_batch_whose_run_keeps_failing_is_ended_with_what_its_checkpoint_holds(settings):
    settings.watchdog_grace_seconds = GRACE
    batch = stopped_mid_batch(settings, lines=6, answered=2, completion_window="2s").batch
    # Its index torn (a bad disk, an operator's mistake): every run of it from now on raises.
    asyncio.run(storage_of(settings).save_bytes(f"{batch['id']}.index", b"\x00garbage"))
    with app_on(settings) as client:
        ended = wait_status(client, batch["id"], FINAL, timeout=2 + GRACE + 10)
        assert ended["status"] == "expired"
        assert ended["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
        assert len(read_jsonl(client, ended["output_file_id"])) == 2
        assert client.get("/health").status_code == 200
    assert not [name for name in stored_names(settings) if name.startswith(batch["id"])]


def active_limit_reached(client: TestClient, file_id: str) -> bool:
    """Whether the key's one active-batch slot is taken (settings.max_active_batches_per_key = 1)."""
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return client.post("/v1/batches", json=body).status_code == 429


def watchdog_tracebacks(caplog: pytest.LogCaptureFixture, batch_id: str) -> int:
    """How many times the watchdog logged a traceback for the batch (a record reaches caplog once or twice: through
    the runner's logger, and through the root where it propagates)."""
    found = {
        id(r) for r in caplog.records if r.exc_info and r.getMessage().startswith(f"batch {batch_id}: the watchdog")
    }
    return len(found)


def test_a_batch_whose_ending_raises_is_ended_failed_with_its_checkpoint(settings, monkeypatch, runner_log):
    settings.watchdog_grace_seconds = GRACE
    settings.max_active_batches_per_key = 1
    # Every ending that writes the error lines of requests that never ran raises, as one with a custom_id its writer
    # could not encode did: the run's own at expiry, then the watchdog's.
    monkeypatch.setattr(failpoints, "ARMED", Failpoints(failpoints.UNFINISHED_LINES_RAISE))
    with held_batch(settings, lines=6, answered=2, completion_window="2s") as held:
        client, source, batch = held.client, held.source, held.batch
        assert active_limit_reached(client, source["id"])
        ended = wait_status(client, batch["id"], FINAL, timeout=2 + GRACE + 10)
        assert time.time() <= batch["expires_at"] + GRACE + 5
        assert ended["status"] == "failed" and ended["failed_at"] is not None
        assert [e["code"] for e in ended["errors"]["data"]] == ["results_not_written"]
        assert ended["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
        assert sorted(o["custom_id"] for o in read_jsonl(client, ended["output_file_id"])) == ["r0", "r1"]
        assert not active_limit_reached(client, source["id"])
        assert client.get("/health").status_code == 200
    assert watchdog_tracebacks(runner_log, batch["id"]) == 1  # the ending that raised, once: no retry every second


def test_a_batch_whose_results_cannot_be_read_back_is_ended_failed_without_them(settings, runner_log):
    settings.watchdog_grace_seconds = GRACE
    settings.max_active_batches_per_key = 1
    engine = FakeEngine()
    engine.fail_restarts = True
    with app_on(settings, engine) as client:
        lines = [request_line(f"r{i}") for i in range(4)] + [request_line("poison", seed=1)]
        source = upload(client, jsonl(lines))
        batch = create_batch(client, source["id"], completion_window="2s")
        wait_for(lambda: client.get("/health").json()["status"] == "down")
        wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 4)
        # Its checkpointed output torn in place (a bad disk): every ending that reads it back raises.
        [part] = settings.files_dir.glob(f"{batch['id']}*.output.part")
        part.write_bytes(b"\x00" * part.stat().st_size)
        assert active_limit_reached(client, source["id"])
        ended = wait_status(client, batch["id"], FINAL, timeout=2 + GRACE + 10)
        assert ended["status"] == "failed"
        assert [e["code"] for e in ended["errors"]["data"]] == ["results_not_written"]
        assert ended["output_file_id"] is None and ended["error_file_id"] is None
        assert ended["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
        assert not active_limit_reached(client, source["id"])
    assert watchdog_tracebacks(runner_log, batch["id"]) == 2  # each ending that raised, once
    assert not [name for name in stored_names(settings) if name.startswith(batch["id"])]
