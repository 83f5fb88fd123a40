"""The engine is shared fairly between keys, and a batch waiting for its turn costs nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.domain import batches
from app.engine.sharing.feed import Changes, FairFeed
from app.testing import FakeEngine
from tests.helpers import app_on, jsonl, request_line, wait_for

pytestmark = pytest.mark.both_backends

KEYS = {"a": "sk-fair-a", "b": "sk-fair-b"}


@pytest.fixture
def keyed(tmp_path: Path, fake_engine: FakeEngine):
    settings = Settings(data_dir=tmp_path / "data", api_keys=",".join(KEYS.values()), checkpoint_seconds=0.05)
    with app_on(settings, fake_engine) as client:
        yield client


def submit(client: TestClient, key: str, name: str, lines: int = 20) -> str:
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    content = jsonl([request_line(f"{name}-{i}") for i in range(lines)])
    file_id = client.post(
        "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, headers=headers
    )
    body = {"input_file_id": file_id.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return client.post("/v1/batches", json=body, headers=headers).json()["id"]


def status(client: TestClient, key: str, batch_id: str) -> dict:
    return client.get(f"/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {KEYS[key]}"}).json()


def test_turns_go_round_robin_over_keys(keyed, fake_engine):
    executor = fake_engine.executor
    executor.answer_first = 0  # the first batch fills the engine and keeps its turn until the gate opens
    first = submit(keyed, "a", "A1")
    wait_for(lambda: executor.calls == 8)
    queued = [("a", submit(keyed, "a", "A2")), ("a", submit(keyed, "a", "A3")), ("b", submit(keyed, "b", "B1"))]
    # In progress is not yet queued: the runner opens its files before it asks for a turn.
    wait_for(lambda: keyed.app.state.engine.waiting_for_turn() == 3)
    executor.gate.set()
    for key, batch_id in [("a", first), *queued]:
        wait_for(lambda key=key, batch_id=batch_id: status(keyed, key, batch_id)["status"] == "completed")
    started = list(dict.fromkeys(body["messages"][0]["content"].split()[1].split("-")[0] for body in executor.bodies))
    assert started == ["A1", "B1", "A2", "A3"]  # B's batch, created last, is not behind all of A's


def test_a_batch_waiting_for_its_turn_costs_nothing(keyed, fake_engine, monkeypatch):
    checkpoints: Counter[str] = Counter()
    real_save = batches.save_checkpoint

    def counting_save(**kwargs):
        checkpoints[kwargs["batch_id"]] += 1
        real_save(**kwargs)

    monkeypatch.setattr(batches, "save_checkpoint", counting_save)
    fake_engine.executor.answer_first = 0
    running = submit(keyed, "a", "run")
    # Its turn first: batches validated at once ask for turns in the order they finish validating, not created.
    wait_for(lambda: checkpoints[running] >= 1)
    waiting = [submit(keyed, "b", f"wait{i}") for i in range(5)]
    wait_for(lambda: all(status(keyed, "b", batch_id)["status"] == "in_progress" for batch_id in waiting))
    wait_for(lambda: checkpoints[running] >= 10)  # the running batch has ticked ten times meanwhile
    assert sum(checkpoints[batch_id] for batch_id in waiting) == 0
    # A cancel reaches a waiting batch at once, and it ends without ever having had a turn.
    headers = {"Authorization": f"Bearer {KEYS['b']}"}
    keyed.post(f"/v1/batches/{waiting[0]}/cancel", headers=headers)
    cancelled = wait_for(lambda: (batch := status(keyed, "b", waiting[0]))["status"] == "cancelled" and batch)
    assert cancelled["request_counts"] == {"total": 20, "completed": 0, "failed": 20}
    fake_engine.executor.gate.set()


def test_fair_feed_passes_a_turn_on_when_its_waiter_is_cancelled():
    async def scenario() -> list[str]:
        feed, order = FairFeed(), []
        holder = await feed.turn(owner="a", created_ns=1, batch_id="x")
        dropped = asyncio.create_task(feed.turn(owner="b", created_ns=2, batch_id="y"))
        kept = asyncio.create_task(feed.turn(owner="c", created_ns=3, batch_id="z"))
        await asyncio.sleep(0)
        dropped.cancel()
        holder.release()
        turn = await kept
        order.append(turn.owner)
        turn.release()
        assert feed.waiting() == 0
        return order

    assert asyncio.run(scenario()) == ["c"]


def _wait_for_turn(feed: FairFeed, changes: Changes, owner: str, ending) -> asyncio.Task:
    return asyncio.create_task(
        feed.turn_or_end(owner=owner, created_ns=2, batch_id=owner, changes=changes, deadline=None, ending=ending)
    )


def test_a_turn_granted_while_a_waiting_batch_learns_it_was_cancelled_is_passed_on():
    """Seen in a full run: a shard waiting for its turn looked at its status after a change; while it looked, the
    running batch ended and the turn came to it; it ended cancelled and kept the turn, and every later batch of that
    worker waited for good."""

    async def scenario() -> str:
        feed, changes = FairFeed(), Changes()
        running = await feed.turn(owner="a", created_ns=1, batch_id="running")

        async def cancelled_while_the_turn_comes() -> str:
            running.release()  # the turn goes to the waiter while it looks
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return "cancelled"

        waiting = _wait_for_turn(feed, changes, "b", cancelled_while_the_turn_comes)
        await asyncio.sleep(0)
        changes.notify()
        assert await waiting == "cancelled"
        later = await asyncio.wait_for(feed.turn(owner="c", created_ns=3, batch_id="later"), timeout=5)
        return later.owner

    assert asyncio.run(scenario()) == "c"


def test_a_change_while_a_waiting_batch_looks_is_not_missed():
    async def scenario() -> str:
        feed, changes = FairFeed(), Changes()
        await feed.turn(owner="a", created_ns=1, batch_id="running")  # keeps the turn throughout
        looks: list[int] = []

        async def cancelled_as_it_first_looks() -> str | None:
            looks.append(1)
            if len(looks) == 1:
                changes.notify()  # the cancel lands while the first look reads a status from before it
                return None
            return "cancelled"

        waiting = _wait_for_turn(feed, changes, "b", cancelled_as_it_first_looks)
        await asyncio.sleep(0)
        changes.notify()
        return await asyncio.wait_for(waiting, timeout=5)

    assert asyncio.run(scenario()) == "cancelled"
