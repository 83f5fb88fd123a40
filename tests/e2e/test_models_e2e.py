"""Two models behind one `vbatch api` (issue 30): two `vbatch worker`s with the real CPU engine, the same SmolLM2
weights served under two names, over one SQLite file and data directory; the openai SDK, through the API replica,
creates one batch per model, and each batch runs on the worker that serves its model: every answer's `model` is
the name its line gave, and the batch's lease names that worker's process. A batch for a model neither serves
waits, and says so in its progress."""

from __future__ import annotations

import json
from functools import partial

import httpx
from openai import OpenAI

from app.core.config import Settings
from app.core.db import make_engine
from app.domain import batches
from app.testing import VbatchServer, free_port
from tests.e2e.conftest import MODEL, engine_flags
from tests.e2e.test_crash_recovery import ENV, STARTUP_SECONDS, results, wait_done
from tests.helpers import wait_for

NAMES = ("smol-a", "smol-b")
LINES = 4


def served_as(flags: list[str], name: str) -> list[str]:
    return [name if flag == MODEL else flag for flag in flags]


def lines_for(model: str) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{model}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 8},
            }
        ).encode()
        + b"\n"
        for i in range(LINES)
    )


def answering(server: VbatchServer) -> bool:
    """Its HTTP server is up: its start (the database migrated) is behind it, its engine maybe still loading."""
    assert server.process.poll() is None, f"exited; see {server.log_path}"
    try:
        return httpx.get(f"{server.base_url}/health/live", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def listed(client: OpenAI) -> list[str]:
    return sorted(model.id for model in client.models.list())


def create(client: OpenAI, model: str) -> str:
    source = client.files.create(file=("in.jsonl", lines_for(model)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.model == model  # known from the file's first line at creation
    return batch.id


def test_two_batches_for_two_models_through_one_api_are_each_answered_by_the_model_they_name(tmp_path, model_path):
    data = tmp_path / "data"
    flags = engine_flags(model_path)
    workers: dict[str, VbatchServer] = {}
    servers: list[VbatchServer] = []
    db = make_engine(Settings(data_dir=data).database)
    try:
        for name in NAMES:  # each engine loads while the next starts; one at a time migrates the SQLite file
            port = free_port()
            log = tmp_path / f"{name}.log"
            workers[name] = VbatchServer(data, port, served_as(flags, name), log, env=ENV, role="worker")
            servers.append(workers[name])
            wait_for(partial(answering, workers[name]), timeout=STARTUP_SECONDS)
        for worker in workers.values():
            worker.wait_ready(timeout=STARTUP_SECONDS)
        api = VbatchServer(data, free_port(), [], tmp_path / "api.log", env=ENV, role="api")
        servers.append(api)
        api.wait_ready(timeout=120)
        client = OpenAI(base_url=f"{api.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)
        # Each worker says what it serves every second, and at once when its engine is ready; a worker's beat can
        # wait on a loaded machine's SQLite lock, so the listing is waited for, not read once.
        wait_for(lambda: listed(client) == sorted(NAMES), timeout=30)

        ids = {name: create(client, name) for name in NAMES}
        unserved = create(client, "smol-c")
        for name, batch_id in ids.items():
            batch = wait_done(client, batch_id)
            assert batch.status == "completed" and batch.request_counts.completed == LINES, batch
            answers = results(client, batch.output_file_id)
            assert sorted(line["custom_id"] for line in answers) == sorted(f"{name}-{i}" for i in range(LINES))
            assert {line["response"]["body"]["model"] for line in answers} == {name}
            holder = batches.get(db=db, batch_id=batch_id, owner=None).lease_holder
            assert holder is not None and holder.split("/")[1] == str(workers[name].process.pid)

        progress = httpx.get(f"{api.base_url}/v1/batches/{unserved}/progress", timeout=30).json()
        assert (progress["status"], progress["waiting"]) == ("validating", "waiting for a worker that serves 'smol-c'")
    finally:
        db.dispose()
        for server in reversed(servers):
            server.stop()
