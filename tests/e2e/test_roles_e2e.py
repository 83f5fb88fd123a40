"""`vbatch api` and three `vbatch worker`s with the real CPU engine on Postgres and an S3 store, driven by the openai
SDK through the API replica. Two workers serve the session's model, the third the same SmolLM2 weights under another
name (issue 30), each with a data directory of its own (another machine's). One batch cut into shards runs on both
workers of its model at once; one of them is killed mid-shard, and the other takes its shards over from the
checkpoint's segments in the store once their leases run out. A batch for the other name runs on the worker that
serves it, every answer's `model` the name its line gave; a batch for a model no worker serves waits, and says so.

One fleet for the module: its engines load together once (the module's tests used to start two fleets of two)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from openai import OpenAI
from sqlalchemy.engine import Engine

from app.core.db import make_engine
from app.domain import batches
from app.testing import VbatchServer, free_port
from tests.e2e.conftest import MODEL, engine_flags
from tests.e2e.test_crash_recovery import (
    ENV,
    STARTUP_SECONDS,
    check_exactly_once,
    create,
    request_lines,
    results,
    wait_done,
)
from tests.helpers import holding, pid_of, wait_for

LINES, SHARD_LINES = 18, 6
OTHER_NAME = "smol-b"  # the other name the same weights are served under


@dataclass
class Fleet:
    api: VbatchServer
    held: VbatchServer  # a worker of MODEL whose data directory gets the hold file; the test that kills it runs last
    other: VbatchServer  # the other worker of MODEL
    named: VbatchServer  # the worker of OTHER_NAME
    db: Engine

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.api.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)

    def holder_pid(self, batch_id: str) -> int:
        holder = batches.get(db=self.db, batch_id=batch_id, owner=None).lease_holder
        assert holder is not None
        return pid_of(holder)


def served_as(flags: list[str], name: str) -> list[str]:
    return [name if flag == MODEL else flag for flag in flags]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_path, postgres, s3) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    env = {
        **ENV,
        "VBATCH_DATABASE_URL": postgres.new_database(),
        "VBATCH_STORAGE_URL": s3.new_url(),
        "VBATCH_FAILPOINT": "hold_after:4",  # armed on the worker whose data directory has the hold file
        "VBATCH_SHARD_LINES": str(SHARD_LINES),
        "VBATCH_LEASE_SECONDS": "10",
    }
    flags = engine_flags(model_path)
    shapes = {"worker-1": flags, "worker-2": flags, "worker-3": served_as(flags, OTHER_NAME)}
    servers = [
        VbatchServer(base / name, free_port(), shape, base / f"{name}.log", env=env, role="worker")
        for name, shape in shapes.items()
    ]
    db = make_engine(env["VBATCH_DATABASE_URL"])
    try:
        for worker in servers:  # started together: their engines load at once
            worker.wait_ready(timeout=STARTUP_SECONDS)
        api = VbatchServer(base / "api", free_port(), [], base / "api.log", env=env, role="api")
        servers.append(api)
        api.wait_ready(timeout=120)
        yield Fleet(api, *servers[:3], db=db)
    finally:
        for server in reversed(servers):
            server.stop()
        db.dispose()


def create_for(client: OpenAI, model: str) -> str:
    batch_id = create(client, request_lines(4, model=model))
    assert client.batches.retrieve(batch_id).model == model  # known from the file's first line at creation
    return batch_id


def test_each_batch_runs_on_a_worker_that_serves_its_model_and_answers_in_its_name(fleet: Fleet):
    client = fleet.client()
    # Each worker says what it serves every second, and at once when its engine is ready.
    wait_for(lambda: sorted(model.id for model in client.models.list()) == sorted([MODEL, OTHER_NAME]), timeout=30)
    ids = {model: create_for(client, model) for model in (OTHER_NAME, MODEL)}
    unserved = create_for(client, "smol-c")
    for model, batch_id in ids.items():
        batch = wait_done(client, batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == 4, batch
        answers = results(client, batch.output_file_id)
        assert sorted(line["custom_id"] for line in answers) == [f"req-{i}" for i in range(4)]
        assert {line["response"]["body"]["model"] for line in answers} == {model}
    assert fleet.holder_pid(ids[OTHER_NAME]) == fleet.named.process.pid
    assert fleet.holder_pid(ids[MODEL]) in (fleet.held.process.pid, fleet.other.process.pid)

    progress = httpx.get(f"{fleet.api.base_url}/v1/batches/{unserved}/progress", timeout=30).json()
    assert (progress["status"], progress["waiting"]) == ("validating", "waiting for a worker that serves 'smol-c'")


def test_two_workers_share_a_batch_and_one_killed_mid_shard_is_taken_over_by_the_other(fleet: Fleet):
    client = fleet.client()
    workers = (fleet.held, fleet.other)

    def partial_once_both_have_run_lines() -> list[dict] | None:
        shards = batches.shards_of(db=fleet.db, batch_id=batch_id)
        ran_on = {pid_of(row.lease_holder) for row in shards if row.completed and row.lease_holder}
        if ran_on != {worker.process.pid for worker in workers}:
            return None
        response = httpx.get(f"{fleet.api.base_url}/v1/batches/{batch_id}/partial_output", timeout=30)
        return [json.loads(line) for line in response.content.splitlines()]

    with holding(fleet.held.data_dir):  # worker-1 sends 4 lines of a shard, then holds
        batch_id = create(client, request_lines(LINES))
        seen = wait_for(partial_once_both_have_run_lines, timeout=300)
        fleet.held.kill()
    batch = wait_done(client, batch_id)
    assert batch.status == "completed"
    check_exactly_once(client, batch, LINES, seen)
    logs = [worker.log_path.read_text() for worker in workers]
    assert sum(f"{LINES} requests in 3 shards" in log for log in logs) == 1
    assert ": held again (lease token" in logs[1], logs[1][-3000:]  # worker-1's shard, by worker-2
    wait_for(lambda: not list((fleet.other.data_dir / "files").iterdir()))  # its scratch emptied once done
