"""Retention: expired files leave the disk and the database; an active batch's input stays; nothing else moves."""

from __future__ import annotations

import asyncio

import pytest
from sqlmodel import col, select

from app.core import clock
from app.core.db import session_scope
from app.domain import files, retention
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow, FileRow
from tests.helpers import FINAL, app_on, create_batch, jsonl, request_line, stored_names, upload, wait_for, wait_status

pytestmark = pytest.mark.both_backends

HOUR = 3600


def upload_expiring(client, content: bytes, seconds: int, purpose: str = "batch") -> dict:
    response = client.post(
        "/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": purpose, "expires_after[anchor]": "created_at", "expires_after[seconds]": str(seconds)},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_expired_files_go_from_disk_and_database_and_an_active_batchs_input_stays(client, settings, fake_engine):
    short = upload_expiring(client, jsonl([request_line("s")]), HOUR)
    kept = upload(client, b"notes", purpose="user_data")  # no expiry at all
    done = create_batch(
        client,
        upload(client, jsonl([request_line("d")]))["id"],
        output_expires_after={"anchor": "created_at", "seconds": HOUR},
    )
    done = wait_status(client, done["id"], FINAL)
    fake_engine.executor.answer_first = fake_engine.executor.calls  # the next batch stays running
    in_use = upload_expiring(client, jsonl([request_line(f"r{i}") for i in range(3)]), HOUR)
    active = create_batch(client, in_use["id"])
    wait_for(lambda: client.get(f"/v1/batches/{active['id']}").json()["status"] == "in_progress")

    later = clock.now() + 2 * HOUR
    db, storage = client.app.state.db, client.app.state.storage
    assert set(retention.expired_files(db=db, now=later)) == {short["id"], done["output_file_id"]}
    removed = asyncio.run(retention.sweep(db=db, storage=storage, now=later, keep_events_seconds=0))
    assert removed == 2
    on_disk = set(stored_names(settings))
    assert short["id"] not in on_disk and done["output_file_id"] not in on_disk
    assert {in_use["id"], kept["id"]} <= on_disk
    assert any(name.startswith(active["id"]) for name in on_disk)  # the running batch's own files are untouched
    for gone in (short["id"], done["output_file_id"]):
        assert client.get(f"/v1/files/{gone}").status_code == 404
    assert client.get(f"/v1/files/{kept['id']}").status_code == 200
    # Once its batch has ended, the input goes too.
    client.post(f"/v1/batches/{active['id']}/cancel")
    wait_status(client, active["id"], FINAL)
    assert in_use["id"] in retention.expired_files(db=db, now=later)


def test_the_periodic_sweeper_runs_on_its_own(settings, fake_engine, monkeypatch):
    settings.retention_sweep_seconds = 0.05
    with app_on(settings, fake_engine) as client:
        short = upload_expiring(client, jsonl([request_line("s")]), HOUR)
        real_now = clock.now
        monkeypatch.setattr(clock, "now", lambda: real_now() + 2 * HOUR)
        wait_for(lambda: short["id"] not in stored_names(settings))


def test_shards_left_by_a_crash_after_their_parent_ended_go_with_their_files(client, settings, fake_engine):
    """A worker that dies between its parent's commit and deleting the shards leaves hidden rows and files."""
    ended = wait_status(client, create_batch(client, upload(client, jsonl([request_line("e")]))["id"])["id"], FINAL)
    fake_engine.executor.answer_first = fake_engine.executor.calls  # the next batch stays running
    running = create_batch(client, upload(client, jsonl([request_line("r")]))["id"])
    wait_for(lambda: client.get(f"/v1/batches/{running['id']}").json()["status"] == "in_progress")
    db, storage = client.app.state.db, client.app.state.storage
    results = {b["id"]: upload(client, b'{"custom_id": "x"}\n', purpose="user_data") for b in (ended, running)}
    with session_scope(db) as session:
        for parent_id, result in results.items():
            stored = session.get(FileRow, result["id"])
            stored.owner = files.SHARD_OWNER
            shard = BatchRow.model_validate(session.get(BatchRow, parent_id).model_dump())
            shard.id, shard.parent_id, shard.shard = f"{parent_id}_s0", parent_id, 0
            shard.status, shard.output_file_id = BatchStatus.COMPLETED, result["id"]
            session.add_all([stored, shard])
        session.commit()

    asyncio.run(retention.sweep(db=db, storage=storage, now=clock.now(), keep_events_seconds=0))
    with session_scope(db) as session:
        left = {row.id for row in session.exec(select(BatchRow).where(col(BatchRow.parent_id).is_not(None)))}
    assert left == {f"{running['id']}_s0"}  # an active parent's shard stays
    assert results[ended["id"]]["id"] not in stored_names(settings)
    assert results[running["id"]]["id"] in stored_names(settings)
    assert client.get(f"/v1/batches/{ended['id']}").json() == ended  # the parent itself is untouched
