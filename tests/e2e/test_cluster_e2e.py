"""`vbatch cluster` with the real CPU engine: one `vbatch worker` replica in a Ray actor (a local Ray instance the
command starts), on Postgres and an S3 store, driven by the openai SDK through `vbatch api`; SIGTERM stops it
cleanly."""

from __future__ import annotations

import os
import signal

from openai import OpenAI

from app.testing import VbatchServer, free_port
from tests.e2e.conftest import MODEL, engine_flags
from tests.e2e.test_crash_recovery import ENV, STARTUP_SECONDS, check_exactly_once, create, request_lines, wait_done


def test_vbatch_cluster_runs_batches_on_a_ray_replica_and_stops_on_sigterm(tmp_path, model_path, postgres, s3):
    env = {**ENV, "VBATCH_DATABASE_URL": postgres.new_database(), "VBATCH_STORAGE_URL": s3.new_url()}
    flags = ["--replicas", "1", "--gpus-per-replica", "0", *engine_flags(model_path)]
    workers = tmp_path / "workers"
    launched = VbatchServer(workers, free_port(), flags, tmp_path / "cluster.log", env=env, role="cluster")
    api = VbatchServer(tmp_path / "api", free_port(), [], tmp_path / "api.log", env=env, role="api")
    try:
        api.wait_ready(timeout=STARTUP_SECONDS)  # ready once the replica's engine serves
        client = OpenAI(base_url=f"{api.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)
        assert [model.id for model in client.models.list()] == [MODEL]
        batch = wait_done(client, create(client, request_lines(8)))
        assert batch.status == "completed"
        check_exactly_once(client, batch, 8, [])
        assert (workers / "replica-0").is_dir()  # with a store, the replica's scratch is its own
        os.kill(launched.process.pid, signal.SIGTERM)
        assert launched.wait_exit(timeout=120) == 0
        assert "stopping its replicas" in launched.log_path.read_text()
    finally:
        api.stop()
        launched.stop()
