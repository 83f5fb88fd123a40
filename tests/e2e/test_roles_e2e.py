"""`vbatch api` and `vbatch worker` with the real CPU engine on Postgres and an S3 store, driven by the openai SDK
through the API replica: a worker killed mid-batch is replaced, and the next one, with a data directory of its own
(another machine's), resumes the batch from the checkpoint's segments in the store."""

from __future__ import annotations

import json

import httpx
from openai import OpenAI

from app.testing import VbatchServer, free_port
from tests.e2e.conftest import MODEL, engine_flags
from tests.e2e.test_crash_recovery import ENV, STARTUP_SECONDS, check_exactly_once, create, request_lines, wait_done
from tests.helpers import holding, wait_for


def test_a_worker_killed_mid_batch_is_replaced_and_its_batch_resumes_through_the_api(
    tmp_path, model_path, postgres, s3
):
    data = tmp_path / "worker-1"
    data.mkdir()
    env = {
        **ENV,
        "VBATCH_DATABASE_URL": postgres.new_database(),
        "VBATCH_STORAGE_URL": s3.new_url(),
        "VBATCH_FAILPOINT": "hold_after:4",
    }
    flags = engine_flags(model_path)
    servers = [VbatchServer(data, free_port(), flags, tmp_path / "worker-1.log", env=env, role="worker")]
    try:
        servers[0].wait_ready(timeout=STARTUP_SECONDS)
        api = VbatchServer(tmp_path / "api", free_port(), [], tmp_path / "api.log", env=env, role="api")
        servers.append(api)
        api.wait_ready(timeout=120)
        client = OpenAI(base_url=f"{api.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)
        assert [model.id for model in client.models.list()] == [MODEL]  # what the worker said it serves

        def partial() -> list[dict] | None:
            response = httpx.get(f"{api.base_url}/v1/batches/{batch_id}/partial_output", timeout=30)
            lines = [json.loads(line) for line in response.content.splitlines()]
            return lines if len(lines) >= 2 else None

        with holding(data):  # the worker sends 4 lines of the batch, then holds
            batch_id = create(client, request_lines(12))
            seen = wait_for(partial, timeout=300)
            servers[0].kill()
        second = tmp_path / "worker-2"
        replacement = VbatchServer(second, free_port(), flags, tmp_path / "worker-2.log", env=env, role="worker")
        servers.append(replacement)
        replacement.wait_ready(timeout=STARTUP_SECONDS)
        batch = wait_done(client, batch_id)
        assert batch.status == "completed"
        check_exactly_once(client, batch, 12, seen)
        wait_for(lambda: not list((second / "files").iterdir()))  # its scratch emptied once its batch has ended
        # The dead worker's lease was freed at the replacement's start, not waited out.
        assert "freed the leases of 1 holders on this host" in replacement.log_path.read_text()
    finally:
        for server in servers:
            server.stop()
