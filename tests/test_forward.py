"""`vbatch api` forwards online requests to the workers (`app.engine.forward`): `WorkersView.respond` over the
workers table, against stand-in workers on real sockets (`tests/standin_worker.py`: in this process, or in a
process of their own to kill or freeze), and against a `vbatch worker` process (fake engine) that says in its beats
where it answers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from app.core import calls
from app.core.config import Settings
from app.core.db import make_engine, session_scope
from app.core.migrate import upgrade_to_head
from app.domain import workers
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.domain.online import ONLINE_ENDPOINTS, EngineUnavailable, OnlineAnswer
from app.domain.schemas import RunStats
from app.domain.workers import WorkerState
from app.engine.service import EngineService
from app.engine.view import WorkersView
from app.main import create_app
from app.testing import FakeEngine, VbatchServer, free_port
from tests.helpers import serving, wait_for
from tests.standin_worker import EVENTS, STREAM, Standin

MODEL = "standin-model"
CALLER = calls.Call("req_forwarded", "Bearer sk-caller")
CHAT = "/v1/chat/completions"


def worker(name: str, url: str | None, *, in_flight: int = 0, state: str = "ok", started_at: int = 1) -> WorkerState:
    return WorkerState(
        holder=name,
        started_at=started_at,
        state=state,
        served_models=[MODEL],
        engine_config={},
        scheduler_error=None,
        engine_deaths=0,
        url=url,
        online_in_flight=in_flight,
    )


@contextmanager
def workers_table(settings: Settings, *beats: WorkerState) -> Iterator[Engine]:
    """The database with these workers' beats in it, just now."""
    upgrade_to_head(settings.database)
    db = make_engine(settings.database)
    try:
        for beat in beats:
            workers.beat(db=db, worker=beat)
        yield db
    finally:
        db.dispose()


@asynccontextmanager
async def api_view(db: Engine, settings: Settings) -> AsyncIterator[WorkersView]:
    """What `vbatch api` sees of the engine, answering a request of CALLER's."""
    view = WorkersView()
    await view.start(db=db, storage=None, settings=settings)  # type: ignore[arg-type]  # it keeps no files
    try:
        with calls.answering(CALLER):
            yield view
    finally:
        await view.stop()


@contextmanager
def standin(name: str) -> Iterator[tuple[Standin, str]]:
    """A stand-in worker on a thread of this process, and its URL."""
    worker_app = Standin(name)
    with serving(worker_app.app, free_port()) as port:
        yield worker_app, f"http://127.0.0.1:{port}"


@contextmanager
def standin_process(tmp_path: Path, name: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A stand-in worker in a process of its own (to kill or freeze), and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / f"{name}.log").open("wb") as log:
        command = [sys.executable, "-m", "tests.standin_worker", "--port", str(port), "--name", name]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: _answers(url), timeout=60)
            yield process, url
        finally:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.post(f"{url}{CHAT}", json={}, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


async def whole(answer: OnlineAnswer, seconds: float = 20) -> list[bytes]:
    """Every chunk of a streamed answer, failing the test if it has not ended within `seconds`."""
    assert answer.events is not None
    async with asyncio.timeout(seconds):
        return [chunk async for chunk in answer.events]


def test_a_json_answer_comes_back_as_the_worker_gave_it_with_the_callers_key_and_request_id(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> list[OnlineAnswer]:
            async with api_view(db, settings) as view:
                answers = [await view.respond(path, {"model": MODEL, "n": 1}) for path in ONLINE_ENDPOINTS]
                answers.append(await view.respond(CHAT, {"model": MODEL, "status": 400}))
                assert view._forwarder is not None and not view._forwarder.in_flight
                return answers

        *answered, refused = asyncio.run(scenario())
    for path, answer in zip(ONLINE_ENDPOINTS, answered, strict=True):
        assert answer.status == 200 and answer.events is None
        assert answer.body == {
            "worker": "a",
            "path": path,
            "authorization": "Bearer sk-caller",
            "request_id": "req_forwarded",
            "body": {"model": MODEL, "n": 1},
        }
    assert refused.status == 400  # the worker's refusal is the answer, as it gave it
    assert refused.body == {"error": {"message": "refused", "type": "BadRequestError", "param": None, "code": 400}}


def test_a_stream_comes_back_byte_for_byte_in_whole_events(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> tuple[OnlineAnswer, list[bytes]]:
            async with api_view(db, settings) as view:
                answer = await view.respond(CHAT, {"model": MODEL, "stream": True})
                chunks = await whole(answer)
                assert view._forwarder is not None and not view._forwarder.in_flight
                return answer, chunks

        answer, chunks = asyncio.run(scenario())
    assert answer.status == 200 and answer.body is None
    assert b"".join(chunks) == STREAM  # the worker sent it in pieces cut mid-event
    assert all(chunk.endswith(b"\n\n") for chunk in chunks)


def test_closing_a_stream_early_closes_it_at_the_worker(settings):
    with standin("a") as (worker_app, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> None:
            async with api_view(db, settings) as view:
                begun, unread = [await view.respond(CHAT, {"model": MODEL, "stream": True, "hold": True}) for _ in "ab"]
                assert begun.events is not None and unread.events is not None
                assert await anext(begun.events) == EVENTS[0]
                for answer in (begun, unread):
                    await answer.events.aclose()  # type: ignore[union-attr]
                assert view._forwarder is not None and not view._forwarder.in_flight
                # The worker hears its client leave, each time (so it aborts the request in its engine).
                for _ in "ab":
                    await asyncio.to_thread(worker_app.left.get, timeout=20)

        asyncio.run(scenario())


def test_a_request_no_ready_worker_can_answer_is_refused_as_engine_unavailable(settings):
    with standin("a") as (worker_app, url):
        ready_elsewhere = [worker("starting", url, state="starting"), worker("old", None)]  # no URL: an old worker
        with workers_table(settings, *ready_elsewhere) as db:

            async def scenario() -> list[EngineUnavailable]:
                refusals = []
                async with api_view(db, settings) as view:
                    for body in ({"model": MODEL}, {"model": "another-model"}):
                        with pytest.raises(EngineUnavailable) as refused:
                            await view.respond(CHAT, body)
                        refusals.append(refused.value)
                return refusals

            refusals = asyncio.run(scenario())
    assert {refusal.code for refusal in refusals} == {"engine_unavailable"}
    assert "unreachable" in str(refusals[0])
    assert worker_app.requests == []


def test_with_no_worker_at_all_the_api_says_the_engine_is_starting(settings):
    with workers_table(settings) as db:

        async def scenario() -> None:
            async with api_view(db, settings) as view:
                with pytest.raises(EngineUnavailable, match="it is starting"):
                    await view.respond(CHAT, {"model": MODEL})

        asyncio.run(scenario())


def test_the_least_busy_worker_answers_counting_what_this_replica_has_sent_it(settings):
    with standin("a") as (_, a_url), standin("b") as (_, b_url):
        # `a` is older (first in the table's order) and said it has one online request in flight; `b` none.
        beats = (worker("a", a_url, in_flight=1, started_at=1), worker("b", b_url, in_flight=0, started_at=2))
        with workers_table(settings, *beats) as db:

            async def scenario() -> list[str]:
                answered_by = []
                async with api_view(db, settings) as view:
                    held = await view.respond(CHAT, {"model": MODEL, "stream": True, "hold": True})  # to b (0 < 1)
                    for _ in range(2):
                        answer = await view.respond(CHAT, {"model": MODEL})  # b's 0 + 1 held ties a's 1: a, older
                        answered_by.append(answer.body["worker"])  # type: ignore[index]
                    assert held.events is not None
                    await held.events.aclose()  # type: ignore[attr-defined]
                    answer = await view.respond(CHAT, {"model": MODEL})  # b is back to 0
                    answered_by.append(answer.body["worker"])  # type: ignore[index]
                return answered_by

            assert asyncio.run(scenario()) == ["a", "a", "b"]


def test_a_worker_that_cannot_be_connected_to_is_passed_over_for_the_next(settings):
    with standin("live") as (live_app, url):
        nobody_listens = f"http://127.0.0.1:{free_port()}"
        beats = (worker("gone", nobody_listens, in_flight=0), worker("live", url, in_flight=5))
        with workers_table(settings, *beats) as db:

            async def scenario() -> list[str]:
                async with api_view(db, settings) as view:
                    answers = [await view.respond(CHAT, {"model": MODEL, "n": n}) for n in range(2)]
                    return [answer.body["worker"] for answer in answers]  # type: ignore[index]

            assert asyncio.run(scenario()) == ["live", "live"]
    assert [body["n"] for body in live_app.requests] == [0, 1]  # each sent once


def test_when_both_tries_cannot_connect_the_request_is_refused(settings):
    beats = [worker(name, f"http://127.0.0.1:{free_port()}") for name in ("gone1", "gone2", "gone3")]
    with workers_table(settings, *beats) as db:

        async def scenario() -> None:
            async with api_view(db, settings) as view:
                with pytest.raises(EngineUnavailable, match="unreachable"):
                    await view.respond(CHAT, {"model": MODEL})

        asyncio.run(scenario())


def test_a_json_answer_cut_off_midway_is_refused_as_engine_unavailable(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> None:
            async with api_view(db, settings) as view:
                with pytest.raises(EngineUnavailable):
                    await view.respond(CHAT, {"model": MODEL, "cut": True})
                assert view._forwarder is not None and not view._forwarder.in_flight

        asyncio.run(scenario())


def test_a_stream_cut_off_mid_event_ends_with_an_error_event_in_place_of_the_half_event(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> list[bytes]:
            async with api_view(db, settings) as view:
                return await whole(await view.respond(CHAT, {"model": MODEL, "stream": True, "cut": True}))

        first, last = asyncio.run(scenario())
    assert first == EVENTS[0]
    assert error_of(last)["message"] == "The worker answering this request went away mid-answer; try again."


def stream_cut_short(settings: Settings, url: str, cut: signal.Signals, process: subprocess.Popen) -> list[bytes]:
    """What a held stream from the worker at `url` still gives after `cut` is sent to the worker's process."""
    with workers_table(settings, worker("w", url)) as db:

        async def scenario() -> list[bytes]:
            async with api_view(db, settings) as view:
                answer = await view.respond(CHAT, {"model": MODEL, "stream": True, "hold": True})
                assert answer.events is not None
                assert await anext(answer.events) == EVENTS[0]
                os.kill(process.pid, cut)
                rest = await whole(answer)
                assert view._forwarder is not None and not view._forwarder.in_flight
                return rest

        return asyncio.run(scenario())


def error_of(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[len(b"data: ") :])["error"]


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event(settings, tmp_path):
    with standin_process(tmp_path, "killed") as (process, url):
        rest = stream_cut_short(settings, url, signal.SIGKILL, process)
    # The half event it had begun is dropped; the error event is vLLM's shape for a stream that fails.
    [event] = rest
    assert error_of(event) == {
        "message": "The worker answering this request went away mid-answer; try again.",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }


def test_a_worker_silent_past_the_bound_ends_the_stream_with_an_error_event(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", forward_silence_seconds=1.0)
    with standin_process(tmp_path, "frozen") as (process, url):
        try:
            rest = stream_cut_short(settings, url, signal.SIGSTOP, process)
        finally:
            os.kill(process.pid, signal.SIGCONT)
    [event] = rest
    assert error_of(event)["message"].startswith("The worker answering this request stopped sending")


@pytest.fixture
def keyed_worker(tmp_path: Path) -> Iterator[tuple[VbatchServer, Settings]]:
    """A `vbatch worker` process (fake engine) with a key, logging JSON."""
    env = {"VBATCH_API_KEYS": "sk-forward", "VBATCH_LOG_FORMAT": "json"}
    data_dir = tmp_path / "data"
    server = VbatchServer(data_dir, free_port(), [], tmp_path / "worker.log", env, fake_engine=True, role="worker")
    try:
        server.wait_ready(timeout=120)
        yield server, Settings(data_dir=data_dir)
    finally:
        server.stop()


def test_a_vbatch_worker_says_where_it_answers_and_gets_the_callers_key_and_request_id(keyed_worker):
    server, settings = keyed_worker
    with workers_table(settings) as db:
        [seen] = workers.seen(db=db, within_seconds=10)
        assert (seen.url, seen.online_in_flight) == (server.base_url, 0)

        async def scenario() -> list[OnlineAnswer]:
            answers = []
            async with api_view(db, settings) as view:
                for call in (
                    calls.Call("req_wrong_key", "Bearer sk-wrong"),
                    calls.Call("req_right_key", "Bearer sk-forward"),
                ):
                    with calls.answering(call):
                        answers.append(await view.respond(CHAT, {"model": "fake-model", "messages": []}))
            return answers

        refused, passed = asyncio.run(scenario())
    assert refused.status == 401 and refused.body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    assert passed.status != 401  # the worker took the caller's key

    def logged(request_id: str) -> bool:
        lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
        return any(line.get("request_id") == request_id and line.get("path") == CHAT for line in lines)

    wait_for(lambda: logged("req_right_key") and logged("req_wrong_key"))  # under the caller's request ids


def test_each_request_is_its_own_call_its_id_and_key_as_the_caller_sent_them(settings):
    app = create_app(settings, EngineService(FakeEngine()))
    app.add_api_route("/v1/seen-call", lambda: vars(calls.current()) if calls.current() else None)
    with TestClient(app) as client:
        sent = client.get("/v1/seen-call", headers={"x-request-id": "req_mine", "authorization": "Bearer sk-x"})
        fresh = client.get("/v1/seen-call").json()
    assert sent.json() == {"request_id": "req_mine", "authorization": "Bearer sk-x"}
    assert fresh["authorization"] is None and fresh["request_id"].startswith("req_")
    assert calls.current() is None  # outside a request


def test_an_advertised_url_must_be_a_base_url():
    assert Settings(host="0.0.0.0", port=8001).advertised_url.endswith(":8001")
    assert Settings(host="::1", port=8001).advertised_url == "http://[::1]:8001"
    assert Settings(advertise_url="http://10.0.0.7:8001/").advertised_url == "http://10.0.0.7:8001"
    for wrong in ("10.0.0.7:8001", "ftp://host:1", "http://host:1/v1", "http://:8001"):
        with pytest.raises(ValueError, match="VBATCH_ADVERTISE_URL must be a base URL"):
            Settings(advertise_url=wrong)


def _running_batch(db: Engine, batch_id: str, holder: str) -> None:
    stats = RunStats(requests_per_second=23.8, output_tokens_per_second=190.0, eta_seconds=6.4, timeline={})
    with session_scope(db) as session:
        session.add(
            BatchRow(
                id=batch_id,
                created_ns=time.time_ns(),
                endpoint=CHAT,
                input_file_id="file-x",
                completion_window="24h",
                status=BatchStatus.IN_PROGRESS,
                created_at=int(time.time()),
                lease_holder=holder,
                lease_expires_ns=time.time_ns() + 30 * 10**9,
                live_json=stats.model_dump_json(),
            )
        )
        session.commit()


def test_a_replica_shows_no_live_numbers_of_a_dead_workers_batch_and_says_down_once_its_workers_are_gone(settings):
    never = WorkersView()
    assert never.state == "starting"  # no worker has spoken yet
    with workers_table(settings, worker("alive", None)) as db:
        _running_batch(db, "batch_alive", "alive")
        _running_batch(db, "batch_orphan", "dead")  # its worker was killed: its lease has not run out yet

        async def scenario() -> tuple[object, object, str, str]:
            view = WorkersView()
            await view.start(db=db, storage=None, settings=settings)  # type: ignore[arg-type]
            try:
                alive = await asyncio.to_thread(view.live_stats, "batch_alive")
                orphan = await asyncio.to_thread(view.live_stats, "batch_orphan")
                before = await asyncio.to_thread(lambda: view.state)
                await asyncio.to_thread(workers.forget, db=db, holder="alive")
                view._read_at = 0.0  # read the table again now, not in a second
                return alive, orphan, before, await asyncio.to_thread(lambda: view.state)
            finally:
                await view.stop()

        alive, orphan, before, after = asyncio.run(scenario())
    assert isinstance(alive, RunStats) and alive.eta_seconds == 6.4
    assert orphan is None
    assert (before, after) == ("ok", "down")
