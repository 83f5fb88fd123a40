"""`vbatch api` in front of two `vbatch worker` processes (fake engines) over one SQLite file, driven by the openai
SDK: online requests through the API replica reach a worker, streamed and not; a stream held open makes the other
worker the least busy; a worker killed mid-stream ends the client's stream with an error, not a hang."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from app.testing import VbatchServer, free_port
from tests.helpers import wait_for

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def api_and_workers(tmp_path: Path) -> Iterator[tuple[VbatchServer, list[VbatchServer]]]:
    servers: list[VbatchServer] = []
    try:
        for role in ("worker", "worker", "api"):  # the first migrates the database
            log = tmp_path / f"{role}{len(servers)}.log"
            server = VbatchServer(
                tmp_path / "data", free_port(), [], log, {"VBATCH_LOG_FORMAT": "json"}, fake_engine=True, role=role
            )
            servers.append(server)
            server.wait_ready(timeout=120)
        yield servers[2], servers[:2]
    finally:
        for server in servers:
            server.stop()


def answered_by(workers: list[VbatchServer], request_id: str) -> VbatchServer | None:
    """The worker whose log has the request (each logs a request once it is answered)."""
    for worker in workers:
        for line in worker.log_path.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("request_id") == request_id:
                return worker
    return None


def test_online_requests_through_the_api_reach_the_least_busy_worker(api_and_workers):
    api, workers = api_and_workers
    client = OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert client.chat.completions.create(model="fake-model", messages=HI).choices[0].message.content
    streamed = client.chat.completions.create(model="fake-model", messages=HI, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)

    held = client.chat.completions.create(
        model="fake-model", messages=HI, stream=True, extra_body={"stream_hold": True}
    )
    next(iter(held))  # its worker now has one online request in flight, as this replica counts
    client.chat.completions.create(model="fake-model", messages=HI, extra_headers={"x-request-id": "req_next"})
    next_worker = wait_for(lambda: answered_by(workers, "req_next"))
    [holding] = [worker for worker in workers if worker is not next_worker]
    os.killpg(holding.process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="went away mid-answer"):
        for _ in held:
            pass
    assert httpx.get(f"{api.base_url}/health").status_code == 200  # the other worker still answers
