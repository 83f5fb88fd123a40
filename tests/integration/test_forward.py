"""`vbatch api` forwards online requests to the workers (`app.engine.online.forward`): `WorkersView.respond` over the
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
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from app.core import calls
from app.core.config import Settings
from app.core.db import make_engine, session_scope
from app.core.fleet import FLEET_HEADER, FleetKey
from app.core.migrate import upgrade_to_head
from app.domain import workers
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.domain.online import ONLINE_ENDPOINTS, EngineUnavailable, OnlineAnswer, OnlineRequest
from app.domain.schemas import RunStats
from app.domain.workers import WorkerState
from app.engine.online.view import WorkersView
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine, VbatchServer, free_port
from tests.helpers import serving, wait_for
from tests.standin_worker import EVENTS, STREAM, Standin

MODEL = "standin-model"
CALLER = calls.Call("req_forwarded")
TENANT = "0123456789abcdef0123456789abcdef"
CHAT = "/v1/chat/completions"
# The fleet's key as every test process has it (tests/conftest.py sets VBATCH_FLEET_SECRET).
FLEET = FleetKey(os.environ["VBATCH_FLEET_SECRET"].encode())
OTHER_FLEET = FleetKey(b"another-fleet-secret-0123456789")


def online(path: str, body: dict, *, tenant: str = TENANT) -> OnlineRequest:
    """An online request as the API took it: its body as sent is its JSON."""
    return OnlineRequest(path, body, json.dumps(body).encode(), tenant)


def worker(
    name: str,
    url: str | None,
    *,
    in_flight: int = 0,
    state: str = "ok",
    started_at: int = 1,
    fleet: FleetKey | None = FLEET,
) -> WorkerState:
    """A worker's beat; its URL proven with `fleet` (None: not proven, as a row written by hand)."""
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
        url_proof=fleet.worker_proof(name, url) if fleet is not None and url else None,
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


def test_a_json_answer_comes_back_as_the_worker_gave_it_with_the_signed_tenant_never_the_key(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> list[OnlineAnswer]:
            async with api_view(db, settings) as view:
                answers = [await view.respond(online(path, {"model": MODEL, "n": 1})) for path in ONLINE_ENDPOINTS]
                answers.append(await view.respond(online(CHAT, {"model": MODEL, "status": 400})))
                assert view._forwarder is not None and not view._forwarder.in_flight
                return answers

        *answered, refused = asyncio.run(scenario())
    for path, answer in zip(ONLINE_ENDPOINTS, answered, strict=True):
        assert answer.status == 200 and answer.events is None
        seen = answer.body
        assert seen is not None and seen["authorization"] is None  # the caller's key stays at the replica
        assert (seen["worker"], seen["path"], seen["request_id"]) == ("a", path, "req_forwarded")
        assert seen["body"] == {"model": MODEL, "n": 1}
        signed = FLEET.check(seen["fleet"], request_id="req_forwarded", path=path, body=seen["raw"].encode())
        assert signed is not None and signed.tenant == TENANT
        # The signature holds for that body and path only.
        assert FLEET.check(seen["fleet"], request_id="req_forwarded", path=CHAT if path != CHAT else "/v1/x",
                           body=seen["raw"].encode()) is None  # fmt: skip
        assert FLEET.check(seen["fleet"], request_id="req_forwarded", path=path, body=b'{"model":"x"}') is None
    assert refused.status == 400  # the worker's refusal is the answer, as it gave it
    assert refused.body == {"error": {"message": "refused", "type": "BadRequestError", "param": None, "code": 400}}


def test_the_body_goes_to_the_worker_byte_for_byte_as_the_caller_sent_it(settings):
    """A body Python's JSON takes but cannot write back as it came (NaN, a lone surrogate, spacing, key order) is
    passed on as sent: re-encoding it failed with a 500 in the replica."""
    raw = b'{"n": 1,  "model": "standin-model", "temperature": NaN, "top_p": Infinity, "x": "\\ud800"}'
    body = json.loads(raw)
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> OnlineAnswer:
            async with api_view(db, settings) as view:
                return await view.respond(OnlineRequest(CHAT, body, raw, TENANT))

        answer = asyncio.run(scenario())
    assert answer.status == 200 and answer.body is not None
    assert answer.body["raw"].encode() == raw


def test_a_worker_whose_row_does_not_prove_its_url_is_never_sent_a_request(settings):
    """Whoever can write the workers table cannot point a replica at a listener of theirs: a row without the proof
    of the fleet's secret, or with another fleet's, or whose URL was changed after its proof, gets nothing."""
    with standin("listener") as (listener, url), standin("real") as (_, real_url):
        written_by_hand = [
            worker("unproven", url, fleet=None),
            worker("other-fleet", url, fleet=OTHER_FLEET),
            replace(worker("moved", real_url), url=url),  # a genuine proof, for another URL
        ]
        with workers_table(settings, *written_by_hand) as db:

            async def scenario() -> None:
                async with api_view(db, settings) as view:
                    with pytest.raises(EngineUnavailable, match="unreachable"):
                        await view.respond(online(CHAT, {"model": MODEL}))

            asyncio.run(scenario())
    assert listener.requests == []


async def _answered(db: Engine, settings: Settings, model: str = MODEL) -> OnlineAnswer | None:
    async with api_view(db, settings) as view:
        try:
            return await view.respond(online(CHAT, {"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        except EngineUnavailable:
            return None


def test_a_worker_outside_the_allowed_networks_is_never_sent_a_request(tmp_path):
    with standin("a") as (standin_app, url):
        for allowed, answered in (("10.0.0.0/8,worker.example", False), ("127.0.0.0/8", True), ("", True)):
            settings = Settings(data_dir=tmp_path / f"data-{len(allowed)}", fleet_networks=allowed)
            with workers_table(settings, worker("a", url)) as db:
                assert (asyncio.run(_answered(db, settings)) is not None) == answered, allowed
    assert len(standin_app.requests) == 2


def test_a_stream_comes_back_byte_for_byte_in_whole_events(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> tuple[OnlineAnswer, list[bytes]]:
            async with api_view(db, settings) as view:
                answer = await view.respond(online(CHAT, {"model": MODEL, "stream": True}))
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
                held = online(CHAT, {"model": MODEL, "stream": True, "hold": True})
                begun, unread = [await view.respond(held) for _ in "ab"]
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
                            await view.respond(online(CHAT, body))
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
                    await view.respond(online(CHAT, {"model": MODEL}))

        asyncio.run(scenario())


def test_the_least_busy_worker_answers_counting_what_this_replica_has_sent_it(settings):
    with standin("a") as (_, a_url), standin("b") as (_, b_url):
        # `a` is older (first in the table's order) and said it has one online request in flight; `b` none.
        beats = (worker("a", a_url, in_flight=1, started_at=1), worker("b", b_url, in_flight=0, started_at=2))
        with workers_table(settings, *beats) as db:

            async def scenario() -> list[str]:
                answered_by = []
                async with api_view(db, settings) as view:
                    # To b (0 < 1); then b's 0 + 1 held ties a's 1: a, the older, twice.
                    held = await view.respond(online(CHAT, {"model": MODEL, "stream": True, "hold": True}))
                    for _ in range(2):
                        answer = await view.respond(online(CHAT, {"model": MODEL}))
                        answered_by.append(answer.body["worker"])  # type: ignore[index]
                    assert held.events is not None
                    await held.events.aclose()  # type: ignore[attr-defined]
                    answer = await view.respond(online(CHAT, {"model": MODEL}))  # b is back to 0
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
                    answers = [await view.respond(online(CHAT, {"model": MODEL, "n": n})) for n in range(2)]
                    return [answer.body["worker"] for answer in answers]  # type: ignore[index]

            assert asyncio.run(scenario()) == ["live", "live"]
    assert [body["n"] for body in live_app.requests] == [0, 1]  # each sent once


def test_when_both_tries_cannot_connect_the_request_is_refused(settings):
    beats = [worker(name, f"http://127.0.0.1:{free_port()}") for name in ("gone1", "gone2", "gone3")]
    with workers_table(settings, *beats) as db:

        async def scenario() -> None:
            async with api_view(db, settings) as view:
                with pytest.raises(EngineUnavailable, match="unreachable"):
                    await view.respond(online(CHAT, {"model": MODEL}))

        asyncio.run(scenario())


def test_a_json_answer_cut_off_midway_is_refused_as_engine_unavailable(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> None:
            async with api_view(db, settings) as view:
                with pytest.raises(EngineUnavailable):
                    await view.respond(online(CHAT, {"model": MODEL, "cut": True}))
                assert view._forwarder is not None and not view._forwarder.in_flight

        asyncio.run(scenario())


def test_a_stream_cut_off_mid_event_ends_with_an_error_event_in_place_of_the_half_event(settings):
    with standin("a") as (_, url), workers_table(settings, worker("a", url)) as db:

        async def scenario() -> list[bytes]:
            async with api_view(db, settings) as view:
                return await whole(await view.respond(online(CHAT, {"model": MODEL, "stream": True, "cut": True})))

        first, last = asyncio.run(scenario())
    assert first == EVENTS[0]
    assert error_of(last)["message"] == "The worker answering this request went away mid-answer; try again."


def stream_cut_short(settings: Settings, url: str, cut: signal.Signals, process: subprocess.Popen) -> list[bytes]:
    """What a held stream from the worker at `url` still gives after `cut` is sent to the worker's process."""
    with workers_table(settings, worker("w", url)) as db:

        async def scenario() -> list[bytes]:
            async with api_view(db, settings) as view:
                answer = await view.respond(online(CHAT, {"model": MODEL, "stream": True, "hold": True}))
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
    # The half event it had begun is dropped; the error event is the one a stream that fails ends with, in OpenAI's
    # words (`app.domain.openai_errors`).
    [event] = rest
    assert error_of(event) == {
        "message": "The worker answering this request went away mid-answer; try again.",
        "type": "server_error",
        "param": None,
        "code": None,
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


def test_a_vbatch_worker_proves_where_it_answers_and_takes_the_signed_tenant_without_a_key(keyed_worker):
    server, settings = keyed_worker
    with workers_table(settings) as db:
        [seen] = workers.seen(db=db, within_seconds=10)
        assert (seen.url, seen.online_in_flight) == (server.base_url, 0)
        assert FLEET.proves(seen.holder, server.base_url, seen.url_proof)

        async def scenario() -> OnlineAnswer:
            async with api_view(db, settings) as view:
                with calls.answering(calls.Call("req_signed")):
                    return await view.respond(online(CHAT, {"model": "fake-model", "messages": []}))

        passed = asyncio.run(scenario())
    assert passed.status != 401  # the worker took the signed tenant, with no key sent

    def logged(request_id: str) -> bool:
        lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
        return any(line.get("request_id") == request_id and line.get("path") == CHAT for line in lines)

    wait_for(lambda: logged("req_signed"))  # under the caller's request id


def test_a_vbatch_worker_refuses_a_tenant_whose_signature_does_not_hold(keyed_worker):
    server, _ = keyed_worker
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).encode()

    def sent(signature: str, *, request_id: str = "req_1", content: bytes = body) -> httpx.Response:
        headers = {"content-type": "application/json", "x-request-id": request_id, FLEET_HEADER: signature}
        return httpx.post(f"{server.base_url}{CHAT}", content=content, headers=headers, timeout=30)

    good = FLEET.sign(tenant=TENANT, request_id="req_1", path=CHAT, body=body)
    assert sent(good).status_code == 200
    refused = [
        sent(
            FleetKey(b"another-fleet-secret-0123456789").sign(tenant=TENANT, request_id="req_1", path=CHAT, body=body)
        ),
        sent(good, content=body.replace(b"hi", b"yo")),  # another body under a captured signature
        sent(good, request_id="req_2"),
        sent(FLEET.sign(tenant=TENANT, request_id="req_1", path=CHAT, body=body, now=time.time() - 3600)),
        sent("v1;t=1;tenant=;sig=" + "0" * 64),
        sent(good.replace("tenant=" + TENANT, "tenant=" + "f" * 32)),  # another tenant named
    ]
    for response in refused:
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_fleet_signature"
    # A client's own request with the worker's key is still answered; without one, refused as ever.
    keyed = {"authorization": "Bearer sk-forward", "content-type": "application/json"}
    assert httpx.post(f"{server.base_url}{CHAT}", content=body, headers=keyed, timeout=30).status_code == 200
    assert httpx.post(f"{server.base_url}{CHAT}", content=body, timeout=30).status_code == 401


def test_each_request_is_its_own_call_under_the_id_the_caller_sent(settings):
    app = create_app(settings, EngineService(FakeEngine()))
    app.add_api_route("/v1/seen-call", lambda: vars(calls.current()) if calls.current() else None)
    with TestClient(app) as client:
        sent = client.get("/v1/seen-call", headers={"x-request-id": "req_mine", "authorization": "Bearer sk-x"})
        fresh = client.get("/v1/seen-call").json()
    assert sent.json() == {"request_id": "req_mine"}  # the caller's key is no part of it: it is never passed on
    assert fresh["request_id"].startswith("req_")
    assert calls.current() is None  # outside a request


def test_api_replicas_and_workers_refuse_to_start_without_a_fleet_secret(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "VBATCH_FLEET_SECRET"}
    for role, extra in (("api", []), ("worker", []), ("api", ["VBATCH_FLEET_SECRET=short"])):
        command = [sys.executable, "-m", "app.testing", "--role", role, "--data-dir", str(tmp_path / role)]
        run_env = {**env, **dict(item.split("=", 1) for item in extra)}
        done = subprocess.run([*command, "--port", str(free_port())], env=run_env, capture_output=True, timeout=120)
        assert done.returncode != 0
        assert b"VBATCH_FLEET_SECRET" in done.stderr + done.stdout


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


def test_a_worker_served_over_https_is_reached_only_with_the_fleets_ca(tmp_path):
    """`VBATCH_TLS_CERT_FILE`/`_KEY_FILE` make a worker serve https and advertise an https URL; a replica checks its
    certificate against `VBATCH_FLEET_CA_FILE`: with another CA (here: the system's), nothing is sent."""
    import trustme

    ca = trustme.CA()
    ca_file, chain_file = tmp_path / "ca.pem", tmp_path / "worker.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(chain_file))
    env = {"VBATCH_API_KEYS": "sk-tls", "VBATCH_TLS_CERT_FILE": str(chain_file), "VBATCH_TLS_KEY_FILE": str(chain_file)}
    data_dir, port = tmp_path / "data", free_port()
    server = VbatchServer(data_dir, port, [], tmp_path / "worker.log", env, fake_engine=True, role="worker")
    try:
        with workers_table(Settings(data_dir=data_dir)) as db:
            wait_for(lambda: bool(workers.seen(db=db, within_seconds=10)), timeout=120)
            [seen] = workers.seen(db=db, within_seconds=10)
            assert seen.url == f"https://127.0.0.1:{port}"
            trusting = Settings(data_dir=data_dir, fleet_ca_file=ca_file)
            answered = asyncio.run(_answered(db, trusting, "fake-model"))
            assert answered is not None and answered.status == 200
            # With a CA that did not sign it (the system's), nothing is sent.
            assert asyncio.run(_answered(db, Settings(data_dir=data_dir), "fake-model")) is None
    finally:
        server.stop()
