"""A thousand open streams from one key, over real sockets, on the fake engine: another key's online request and its
batch are still answered, and no answer is a 500 (issue 29's "1,000 concurrent streams from one key do not starve
another key's live requests or the batch")."""

from __future__ import annotations

import asyncio
import resource
from collections import Counter

import httpx
import pytest

from app.core.config import Settings
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FAKE_MODEL, FakeEngine, free_port
from tests.helpers import jsonl, request_line, serving, wait_for

STREAMS = 1000
KEY_A, KEY_B = "sk-load-a", "sk-load-b"
CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def many_files():
    """A socket each side for every stream, in one process: more than a default limit of 1,024 files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * STREAMS + 256
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"this machine allows {hard} open files, the test needs {wanted}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def open_streams(base: str) -> tuple[list, list[httpx.Response]]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    client = httpx.AsyncClient(base_url=base, limits=limits, timeout=60,
                               headers={"authorization": f"Bearer {KEY_A}"})  # fmt: skip
    body = {**CHAT, "stream": True}
    opened = [client.stream("POST", "/v1/chat/completions", json=body) for _ in range(STREAMS)]
    responses = list(await asyncio.gather(*(stream.__aenter__() for stream in opened)))
    return [client, opened], responses


async def other_keys_work(base: str) -> tuple[int, dict]:
    """Key B's online request, and its batch run to its end, while every one of A's streams is held open."""
    async with httpx.AsyncClient(base_url=base, timeout=30, headers={"authorization": f"Bearer {KEY_B}"}) as b:
        answered = await b.post("/v1/chat/completions", json=CHAT)
        file_id = (await b.post("/v1/files", data={"purpose": "batch"},
                                files={"file": ("b.jsonl", jsonl([request_line(f"b{i}") for i in range(20)]))})
                   ).json()["id"]  # fmt: skip
        batch = (await b.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"})).json()  # fmt: skip
        for _ in range(600):
            batch = (await b.get(f"/v1/batches/{batch['id']}")).json()
            if batch["status"] in {"completed", "failed", "expired", "cancelled"}:
                break
            await asyncio.sleep(0.1)  # polling, as a client does: the batch's end is the condition
    return answered.status_code, batch


async def scenario(base: str, engine: FakeEngine) -> tuple[Counter, int, dict, Counter]:
    (client, opened), responses = await open_streams(base)
    statuses = Counter(response.status_code for response in responses)
    other_status, batch = await other_keys_work(base)
    engine.executor.open_gate(engine.executor.stream_gate)
    ends = Counter()
    for response in responses:
        text = b"".join([chunk async for chunk in response.aiter_bytes()])
        ends[text.endswith(b"data: [DONE]\n\n")] += 1
    for stream in opened:
        await stream.__aexit__(None, None, None)
    await client.aclose()
    return statuses, other_status, batch, ends


def test_a_thousand_open_streams_from_one_key_leave_another_keys_request_and_batch_answered(
    settings: Settings, many_files
):
    settings.api_keys = f"{KEY_A},{KEY_B}"
    settings.max_connections_per_client = 0  # one address opens them all: the per-client guard is not what is tested
    engine = FakeEngine()
    engine.executor.hold_streams = True  # every stream stops after its first chunk until the gate opens
    service = EngineService(engine)
    with serving(create_app(settings, service), free_port(), backlog=4 * STREAMS) as port:
        wait_for(lambda: service.state == "ok")
        statuses, other_status, batch, ends = asyncio.run(scenario(f"http://127.0.0.1:{port}", engine))
    assert statuses == Counter({200: STREAMS})
    assert other_status == 200
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 20, batch
    assert ends == Counter({True: STREAMS})  # every held stream ended whole once let go
