"""`vbatch api` and two `vbatch worker`s with the real CPU engine on Postgres and an S3 store, driven by the openai
SDK through the API replica: one batch cut into shards runs on both workers at once; one worker is killed
mid-shard, and the other, with a data directory of its own (another machine's), takes its shards over from the
checkpoint's segments in the store once their leases run out."""

from __future__ import annotations

import json

import httpx
from openai import OpenAI

from app.core.db import make_engine
from app.domain import batches
from app.testing import VbatchServer, free_port
from tests.e2e.conftest import MODEL, engine_flags
from tests.e2e.test_crash_recovery import ENV, STARTUP_SECONDS, check_exactly_once, create, request_lines, wait_done
from tests.helpers import holding, wait_for

LINES, SHARD_LINES = 18, 6


def test_two_workers_share_a_batch_and_one_killed_mid_shard_is_taken_over_by_the_other(
    tmp_path, model_path, postgres, s3
):
    env = {
        **ENV,
        "VBATCH_DATABASE_URL": postgres.new_database(),
        "VBATCH_STORAGE_URL": s3.new_url(),
        "VBATCH_FAILPOINT": "hold_after:4",  # armed on the worker whose data directory has the hold file
        "VBATCH_SHARD_LINES": str(SHARD_LINES),
        "VBATCH_LEASE_SECONDS": "10",
    }
    flags = engine_flags(model_path)
    held, other = tmp_path / "worker-1", tmp_path / "worker-2"
    workers = [
        VbatchServer(data, free_port(), flags, tmp_path / f"{data.name}.log", env=env, role="worker")
        for data in (held, other)
    ]
    servers = list(workers)
    db = make_engine(env["VBATCH_DATABASE_URL"])
    try:
        for worker in workers:  # started together: both engines load at once
            worker.wait_ready(timeout=STARTUP_SECONDS)
        api = VbatchServer(tmp_path / "api", free_port(), [], tmp_path / "api.log", env=env, role="api")
        servers.append(api)
        api.wait_ready(timeout=120)
        client = OpenAI(base_url=f"{api.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)
        assert [model.id for model in client.models.list()] == [MODEL]  # what the workers said they serve

        def partial_once_both_have_run_lines() -> list[dict] | None:
            shards = batches.shards_of(db=db, batch_id=batch_id)
            ran_on = {row.lease_holder.split("/")[1] for row in shards if row.completed and row.lease_holder}
            if ran_on != {str(worker.process.pid) for worker in workers}:
                return None
            response = httpx.get(f"{api.base_url}/v1/batches/{batch_id}/partial_output", timeout=30)
            return [json.loads(line) for line in response.content.splitlines()]

        with holding(held):  # worker-1 sends 4 lines of a shard, then holds
            batch_id = create(client, request_lines(LINES))
            seen = wait_for(partial_once_both_have_run_lines, timeout=300)
            workers[0].kill()
        batch = wait_done(client, batch_id)
        assert batch.status == "completed"
        check_exactly_once(client, batch, LINES, seen)
        logs = [worker.log_path.read_text() for worker in workers]
        assert sum(f"{LINES} requests in 3 shards" in log for log in logs) == 1
        assert ": held again (lease token" in logs[1], logs[1][-3000:]  # worker-1's shard, by worker-2
        wait_for(lambda: not list((other / "files").iterdir()))  # its scratch emptied once its batches ended
    finally:
        for server in servers:
            server.stop()
        db.dispose()
