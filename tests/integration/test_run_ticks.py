"""A running batch's ticks (checkpoint, cancel and expiry checks) stop its run when one fails: before, a failed tick
was dropped, and the batch ran on with no checkpoint and deaf to a cancel."""

from __future__ import annotations

from tests.helpers import create_batch, jsonl, request_line, upload, wait_for, wait_status

FINAL = {"completed", "failed", "cancelled", "expired"}


def test_a_tick_that_fails_ends_the_batch_as_its_error_says(client, fake_engine):
    fake_engine.executor.answer_first = 2  # then held: only a tick can end this run
    batch = create_batch(client, upload(client, jsonl([request_line(f"r{i}") for i in range(4)]))["id"])
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 2)
    # Less free space than the reserve keeps: the next checkpoint raises DiskFull, as it does on a full disk.
    client.app.state.storage.reserve.keep_free = 2**62
    ended = wait_status(client, batch["id"], FINAL)
    assert ended["status"] == "failed"
    assert ended["errors"]["data"][0]["code"] == "insufficient_storage"
    assert ended["request_counts"]["completed"] == 2
