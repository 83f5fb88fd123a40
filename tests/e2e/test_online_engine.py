"""Online requests on a real engine (CPU vLLM, SmolLM2), through the engine service as `vbatch serve` builds it, in
this process: its API-side `respond` on the test's own event loop, the engine on its thread. One engine start for
the module; the session's shared server is left alone."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.domain.online import OnlineAnswer, OnlineRequest
from app.engine.online import requests
from app.engine.service import EngineService
from app.launch import service_app
from tests.e2e.conftest import MODEL, STARTUP_SECONDS, engine_flags
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

CHAT = "/v1/chat/completions"


def asked(body: dict, endpoint: str = CHAT) -> OnlineRequest:
    return OnlineRequest.of(endpoint, body)


RUNNING = re.compile(rb"^vllm:num_requests_running(\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)
WAITING = re.compile(rb"^vllm:num_requests_waiting(\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)


SEATS = 4  # --max-num-seqs: a wave the tests can fill


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_path) -> Iterator[TestClient]:
    data = tmp_path_factory.mktemp("online-engine") / "data"
    flags = ["--data-dir", str(data), *engine_flags(model_path), "--max-num-seqs", str(SEATS)]
    app, _ = service_app(flags, "serve")
    engine: EngineService = app.state.engine
    with TestClient(app) as client:
        deadline = time.monotonic() + STARTUP_SECONDS
        while engine.state != "ok":
            assert engine.state in ("starting", "restarting") and time.monotonic() < deadline, engine.state
            time.sleep(0.5)
        yield client


@pytest.fixture
def service(client) -> EngineService:
    return client.app.state.engine


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def running_requests(service: EngineService, gauge: re.Pattern = RUNNING) -> float:
    """vLLM's own gauge, summed over its engines, as `vllm serve`'s /metrics has it."""
    return sum(float(value) for _, value in gauge.findall(service.metrics_text()))


async def until(condition, timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


def payloads(events: list[bytes]) -> list[str]:
    text = b"".join(events).decode()
    assert text.endswith("\n\n")
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block]


def test_the_engine_schedules_online_requests_ahead_of_batch_lines(service):
    assert service.engine_config["scheduling_policy"] == "priority"


@pytest.mark.parametrize(
    ("flags", "policy"),
    [([], "priority"), (["--scheduling-policy", "fcfs"], "fcfs"), (["--scheduling_policy=priority"], "priority")],
)
def test_a_scheduling_policy_the_user_names_wins(flags, policy):
    from app.engine.inference.vllm_adapter import apply_batch_defaults, serve_parser

    args = serve_parser("vbatch serve").parse_args(flags)
    apply_batch_defaults(args)
    assert args.scheduling_policy == policy


def test_a_streamed_chat_answer_is_vllms_server_sent_events(service):
    async def scenario() -> tuple[OnlineAnswer, list[bytes]]:
        answer = await service.respond(asked(chat("Count to five.", stream=True, max_tokens=16)))
        assert answer.events is not None
        return answer, [event async for event in answer.events]

    answer, events = asyncio.run(scenario())
    assert answer.status == 200
    data = payloads(events)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in data[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    # The engine's last chunk is the usage vbatch asks of it for every stream (the API shows it only where asked).
    *answered, usage = chunks
    assert answered[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert usage["choices"] == [] and 1 <= usage["usage"]["completion_tokens"] <= 16


def test_json_answers_are_vllms_bodies_and_a_refused_stream_openais_error(service):
    answer = asyncio.run(service.respond(asked(chat("Say yes.", max_tokens=4, service_tier="flex"))))
    assert answer.status == 200 and answer.body is not None and answer.body["object"] == "chat.completion"
    refused = asyncio.run(service.respond(asked(chat("Say yes.", max_tokens=-1, stream=True))))
    assert refused.status == 400 and refused.events is None and refused.body is not None
    error = refused.body["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "max_tokens", "invalid_value")


def test_a_responses_stream_is_written_as_vllm_serve_writes_it(service):
    async def scenario() -> list[bytes]:
        body = {"model": MODEL, "input": "Say yes.", "stream": True, "max_output_tokens": 8}
        answer = await service.respond(asked(body, "/v1/responses"))
        assert answer.status == 200 and answer.events is not None, answer.body
        return [event async for event in answer.events]

    blocks = [block for block in b"".join(asyncio.run(scenario())).decode().split("\n\n") if block]
    kinds = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    last = json.loads(blocks[-1].split("\n", 1)[1].removeprefix("data: "))
    assert last["type"] == "response.completed" and last["response"]["status"] in ("completed", "incomplete")


@pytest.mark.parametrize("closed_when", ["after its first chunk", "with the engine side waiting for room"])
def test_a_stream_closed_early_leaves_nothing_running(service, closed_when):
    """Closed while the engine side waits for the next token (its cancel reaches vLLM's `generate`), or while it
    waits for the reader to make room (the stream is closed at a chunk: vLLM's generator is finalised)."""
    length = 1500  # tokens: half a minute of this CPU's time, so only an abort ends it sooner

    async def scenario() -> int:
        before = service.engine.generated_tokens() or 0
        answer = await service.respond(
            asked(chat("Write a long story.", stream=True, max_tokens=length, ignore_eos=True))
        )
        assert answer.events is not None
        first = await anext(answer.events)
        assert first.startswith(b"data: ")
        await until(lambda: running_requests(service) >= 1)
        if closed_when != "after its first chunk":
            await until(lambda: (service.engine.generated_tokens() or 0) - before > requests.STREAM_ROOM + 16)
        await answer.events.aclose()  # type: ignore[attr-defined]
        await until(lambda: running_requests(service) == 0)
        return (service.engine.generated_tokens() or 0) - before

    generated = asyncio.run(scenario())
    assert 0 < generated < length  # stopped by the abort, not by its length


def test_an_online_request_into_a_full_engine_withdraws_batch_lines_which_run_again_and_end_once(client, service):
    """Two waves of batch lines held (one running, one queued in the engine): the online request that arrives takes
    a running slot at once, the lines withdrawn for it are aborted in vLLM and run again, and the batch's output has
    every custom_id once, each a full answer."""
    lines = [request_line(f"w{i}", model=MODEL, max_tokens=48, ignore_eos=True) for i in range(3 * SEATS)]
    batch = create_batch(client, upload(client, jsonl(lines))["id"])
    window = service._ctx.window  # type: ignore[union-attr]
    in_engine = (SEATS, SEATS)  # running, waiting
    wait_for(lambda: (running_requests(service), running_requests(service, WAITING)) == in_engine, timeout=120)

    answer = asyncio.run(service.respond(asked(chat("Say yes.", max_tokens=4))))
    assert answer.status == 200 and answer.body is not None and answer.body["object"] == "chat.completion"
    assert window.withdrawn >= SEATS + 1  # the queued wave, and the running line that started last

    done = wait_status(client, batch["id"], {"completed"}, timeout=300)
    assert done["request_counts"] == {"total": 3 * SEATS, "completed": 3 * SEATS, "failed": 0}
    output = read_jsonl(client, done["output_file_id"])
    assert Counter(line["custom_id"] for line in output) == Counter(line["custom_id"] for line in lines)
    assert {line["response"]["body"]["usage"]["completion_tokens"] for line in output} == {48}
    scraped = client.get("/metrics").text
    assert f"vbatch_batch_lines_withdrawn_total {float(window.withdrawn)}" in scraped


def test_every_online_request_above_leaves_the_window_and_the_pace_stops_once_quiet(service):
    """Answered, streamed, refused and closed early (the tests above): each online request the window counted in is
    counted out, so batch lines are no longer paced once the traffic is quiet (one counted forever paced every batch
    after it, and its debt once held a 1-line batch 600 s)."""
    window = service._ctx.window  # type: ignore[union-attr]
    wait_for(lambda: window.online.in_flight == 0 and not window.pacer.active, timeout=30)
    _, pace = service.engine_steps()
    assert pace is not None and not pace.active
