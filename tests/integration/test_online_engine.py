"""Online requests on the engine service (`app.engine.online.requests`), over the fake engine: answers as JSON and as
streams, handed from the engine thread to the caller's loop; a stream closed or a call cancelled reaches the engine
as an abort; an engine that is not ok is refused; and online requests go to the engine ahead of batch lines queued
for the in-flight window, which reach it at batch priority."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.domain.errors import InvalidRequest
from app.domain.online import BATCH_PRIORITY, EngineUnavailable, OnlineAnswer, OnlineRequest
from app.engine.online import requests
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FAKE_MODEL, FakeEngine, FakeServing
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

CHAT = "/v1/chat/completions"


def asked(body: dict, endpoint: str = CHAT) -> OnlineRequest:
    return OnlineRequest.of(endpoint, body)


def chat(content: str = "hello", **fields) -> dict:
    return {"model": FAKE_MODEL, "messages": [{"role": "user", "content": content}], **fields}


@contextmanager
def running(settings: Settings, engine: FakeEngine) -> Iterator[tuple[EngineService, TestClient]]:
    """The app over `engine`, its engine up; the test thread's own event loops stand for the API's."""
    service = EngineService(engine)
    with TestClient(create_app(settings, service)) as client:
        wait_for(lambda: service.state == "ok")
        yield service, client


def on_a_loop(scenario: Callable[[], Awaitable]) -> object:
    return asyncio.run(scenario())


async def until(condition: Callable[[], object], timeout: float = 20.0) -> None:
    """Waits (without blocking the loop) for a condition another thread makes true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def read_all(answer: OnlineAnswer) -> list[bytes]:
    assert answer.events is not None
    return [event async for event in answer.events]


def data_of(events: list[bytes]) -> list[str]:
    """Each event's `data:` payload; every event is one `data: ...` line and a blank line, as vLLM writes them."""
    payloads = []
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
        payloads.append(event[len(b"data: ") : -2].decode())
    return payloads


def test_a_json_answer_comes_back_on_the_callers_loop_with_the_tiers_priority(settings):
    engine = FakeEngine()
    with running(settings, engine) as (service, _):
        answer = on_a_loop(lambda: service.respond(asked(chat(service_tier="priority"))))
        assert isinstance(answer, OnlineAnswer) and answer.status == 200 and answer.events is None
        assert answer.body["object"] == "chat.completion"
        assert answer.body["choices"][0]["message"]["content"] == "ok"
        refused = on_a_loop(lambda: service.respond(asked(chat(max_tokens=-1))))
        assert refused.status == 400 and refused.body["error"]["param"] == "max_tokens"
        on_a_loop(lambda: service.respond(asked(chat("flex", service_tier="flex"))))
        with pytest.raises(InvalidRequest):  # refused on the caller's loop: the engine never sees it
            on_a_loop(lambda: service.respond(asked(chat(service_tier="urgent"))))
    sent = engine.executor.bodies
    assert [body["priority"] for body in sent] == [-1, 0, BATCH_PRIORITY]
    assert all("service_tier" not in body for body in sent)


def test_a_stream_comes_back_as_vllms_server_sent_events(settings):
    engine = FakeEngine()
    with running(settings, engine) as (service, _):

        async def scenario() -> tuple[OnlineAnswer, list[bytes]]:
            answer = await service.respond(asked(chat(stream=True, stream_options={"include_usage": True})))
            return answer, await read_all(answer)

        answer, events = on_a_loop(scenario)
    assert answer.status == 200 and answer.body is None
    payloads = data_of(events)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    deltas = [chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"]]
    assert "".join(deltas) == "ok"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert engine.executor.aborted == []


def test_a_stream_closed_early_is_aborted_in_the_engine(settings):
    engine = FakeEngine()
    engine.executor.hold_streams = True  # each stream stops after its first chunk
    with running(settings, engine) as (service, _):

        async def scenario() -> bytes:
            answer = await service.respond(asked(chat("going away", stream=True)))
            assert answer.events is not None
            first = await anext(answer.events)
            await answer.events.aclose()  # type: ignore[attr-defined]
            await until(lambda: engine.executor.aborted)
            return first

        first = on_a_loop(scenario)
    assert json.loads(data_of([first])[0])["choices"][0]["delta"]["role"] == "assistant"
    assert [body["messages"][0]["content"] for body in engine.executor.aborted] == ["going away"]


def test_a_caller_that_goes_away_before_the_answer_aborts_the_request(settings):
    engine = FakeEngine()
    engine.executor.answer_first = 0  # answers wait for the gate
    with running(settings, engine) as (service, _):

        async def scenario() -> None:
            waiting = asyncio.ensure_future(service.respond(asked(chat("impatient"))))
            await until(lambda: engine.executor.calls == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await until(lambda: engine.executor.aborted)

        on_a_loop(scenario)
    assert [body["messages"][0]["content"] for body in engine.executor.aborted] == ["impatient"]


def test_a_slow_reader_holds_the_stream_back_in_the_engine_not_in_a_queue(settings):
    engine = FakeEngine()
    length = 3 * requests.STREAM_ROOM
    with running(settings, engine) as (service, _):

        async def scenario() -> list[bytes]:
            answer = await service.respond(asked(chat(stream=True, max_tokens=length)))
            assert answer.events is not None
            first = await anext(answer.events)
            # The engine side sends STREAM_ROOM chunks, then holds the next one it read until room is made.
            await until(lambda: engine.executor.streamed_chunks == requests.STREAM_ROOM + 1)
            for _ in range(3):  # the engine loop turns, and the stream stays where it is
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), service._loop))
            assert engine.executor.streamed_chunks == requests.STREAM_ROOM + 1
            return [first, *[event async for event in answer.events]]

        events = on_a_loop(scenario)
    payloads = data_of(events)
    # The engine's own events: its last chunk is the usage vbatch asks of it for every stream (`as_online`).
    chunks = [json.loads(p) for p in payloads[:-1]]
    deltas = [chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"]]
    assert "".join(deltas) == ("ok" * length)[:length] and payloads[-1] == "[DONE]"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_an_engine_death_fails_a_json_request_and_ends_a_started_stream_with_an_error_event(settings):
    engine = FakeEngine()
    with running(settings, engine) as (service, _):
        with pytest.raises(EngineUnavailable) as refused:
            on_a_loop(lambda: service.respond(asked(chat(seed=1))))
        assert refused.value.code == "engine_unavailable"

        async def scenario() -> list[bytes]:
            await until(lambda: service.state == "ok")  # the loop restarts the engine that died
            return await read_all(await service.respond(asked(chat(stream=True, stream_dies=True))))

        events = on_a_loop(scenario)
    payloads = data_of(events)
    assert json.loads(payloads[0])["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(payloads[-1])["error"]
    assert error["code"] is None and error["type"] == "server_error" and error["message"]  # OpenAI's words
    assert len(payloads) == 2  # no [DONE]: the stream did not finish


def test_no_engine_no_answer_while_it_starts_or_after_it_stopped(settings):
    release = threading.Event()
    fake = FakeEngine()

    @asynccontextmanager
    async def slow_start() -> AsyncIterator[FakeServing]:
        await asyncio.to_thread(release.wait)
        async with fake() as serving:
            yield serving

    service = EngineService(slow_start)
    with TestClient(create_app(settings, service)):
        with pytest.raises(EngineUnavailable, match="starting"):
            on_a_loop(lambda: service.respond(asked(chat())))
        release.set()
        wait_for(lambda: service.state == "ok")
        assert on_a_loop(lambda: service.respond(asked(chat()))).status == 200
    with pytest.raises(EngineUnavailable, match="stopped"):
        on_a_loop(lambda: service.respond(asked(chat())))


def test_a_stream_open_when_the_service_stops_ends_rather_than_hangs(settings):
    engine = FakeEngine()
    engine.executor.hold_streams = True
    with running(settings, engine) as (service, _):
        loop = asyncio.new_event_loop()
        answer = loop.run_until_complete(service.respond(asked(chat(stream=True))))
        assert answer.events is not None
        first = loop.run_until_complete(anext(answer.events))
    # The service has stopped with the stream held open in the engine: what is left of it comes, then its end.
    rest = loop.run_until_complete(asyncio.wait_for(read_all(answer), 20))
    loop.close()
    assert json.loads(data_of([first])[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(data_of(rest)[-1])["error"]["type"] == "server_error"  # OpenAI's word for a 503
    assert len(engine.executor.aborted) == 1


def test_online_requests_reach_the_engine_before_queued_batch_lines(settings):
    """The issue's ordering, on the CPU: the in-flight window full of a running batch's lines and more queued, an
    online request is handed to the engine at once, ahead of them; the batch still ends with every line once."""
    settings.max_in_flight = 2
    engine = FakeEngine()
    engine.executor.answer_first = 0  # nothing is answered until the gate opens: the window stays full
    lines = [request_line(f"r{i}") for i in range(6)]
    with running(settings, engine) as (service, client):
        batch = create_batch(client, upload(client, jsonl(lines))["id"])
        wait_for(lambda: engine.executor.calls == 2)

        async def scenario() -> OnlineAnswer:
            online_call = asyncio.ensure_future(service.respond(asked(chat("online"))))
            await until(lambda: engine.executor.calls == 3)
            engine.executor.open_gate()
            return await online_call

        assert on_a_loop(scenario).status == 200
        done = wait_status(client, batch["id"], {"completed"})
        output = read_jsonl(client, done["output_file_id"])
    contents = [body["messages"][0]["content"] for body in engine.executor.bodies]
    assert contents[:3] == ["hi r0", "hi r1", "online"]
    assert sorted(contents[3:]) == [f"hi r{i}" for i in range(2, 6)]
    assert Counter(line["custom_id"] for line in output) == Counter(f"r{i}" for i in range(6))
    batch_bodies = [body for body in engine.executor.bodies if body["messages"][0]["content"] != "online"]
    assert {body["priority"] for body in batch_bodies} == {BATCH_PRIORITY}
    assert engine.executor.bodies[2]["priority"] == 0


def test_under_first_come_first_served_batch_lines_keep_their_own_priority(settings):
    engine = FakeEngine(scheduling_policy="fcfs")
    with running(settings, engine) as (_, client):
        lines = [request_line("plain"), request_line("own", priority=3)]
        batch = create_batch(client, upload(client, jsonl(lines))["id"])
        wait_status(client, batch["id"], {"completed"})
    by_content = {body["messages"][0]["content"]: body for body in engine.executor.bodies}
    assert "priority" not in by_content["hi plain"] and by_content["hi own"]["priority"] == 3


def test_the_batch_window_hears_of_online_traffic_on_the_engine_loop(settings):
    engine = FakeEngine()
    heard: list[tuple[str, object, str]] = []

    def hearing(kind: str) -> Callable[..., None]:
        def heard_it(seconds: float | None = None) -> None:
            heard.append((kind, seconds, threading.current_thread().name))

        return heard_it

    with running(settings, engine) as (service, _):
        wait_for(lambda: service._ctx is not None)
        # The context's window (`app.engine.sharing.window`), or a stand-in before there is one, with its reports
        # recorded.
        window = getattr(service._ctx, "window", None) or SimpleNamespace()
        for kind in ("online_arrived", "online_first_token", "online_done"):
            setattr(window, kind, hearing(kind))
        service._ctx.window = window  # type: ignore[union-attr]
        on_a_loop(lambda: service.respond(asked(chat())))
        on_a_loop(lambda: read_all_of(service.respond(asked(chat(stream=True)))))
    assert [kind for kind, _, _ in heard] == ["online_arrived", "online_first_token", "online_done"] * 2
    assert {thread for _, _, thread in heard} == {"vbatch-engine"}
    first_tokens = [seconds for kind, seconds, _ in heard if kind == "online_first_token"]
    assert all(isinstance(seconds, float) and 0 <= seconds < 20 for seconds in first_tokens)


async def read_all_of(answer: Awaitable[OnlineAnswer]) -> list[bytes]:
    return await read_all(await answer)


def test_a_workers_beat_counts_the_online_requests_its_engine_is_answering(settings):
    """What `vbatch api` picks the least busy worker by (`app.engine.online.forward`)."""
    engine = FakeEngine()
    engine.executor.hold_streams = True  # each stream stops after its first chunk
    with running(settings, engine) as (service, _):
        service.advertise("http://10.0.0.7:8001")

        async def scenario() -> list[int]:
            counts = [service.worker_state().online_in_flight]
            held = [await service.respond(asked(chat(f"held {n}", stream=True))) for n in range(2)]
            counts.append(service.worker_state().online_in_flight)
            await service.respond(asked(chat("answered at once")))
            await until(lambda: service.worker_state().online_in_flight == 2)  # its task ends just after its answer
            await held[0].events.aclose()  # type: ignore[union-attr]
            await until(lambda: service.worker_state().online_in_flight == 1)
            engine.executor.open_gate(engine.executor.stream_gate)
            assert (await read_all(held[1]))[-1] == b"data: [DONE]\n\n"
            await until(lambda: service.worker_state().online_in_flight == 0)
            return counts

        assert on_a_loop(scenario) == [0, 2]
        assert service.worker_state().url == "http://10.0.0.7:8001"
