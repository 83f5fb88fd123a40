"""The online endpoints over HTTP, with the engine's answers played by a double (`tests/online_double.py`): the four
routes, vLLM's and OpenAI's refusals, streams passed through byte for byte, a client that leaves ending its request
in the engine (real sockets), per-key limits with OpenAI's headers, the openai SDK, and the `vbatch_live_*` series."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from app.core.config import Settings
from app.domain.online import ONLINE_ENDPOINTS
from app.engine.online.view import WorkersView
from app.engine.service import EngineService
from app.main import Role, create_app
from app.testing import FakeEngine, free_port
from tests.helpers import FINAL, MODEL, create_batch, jsonl, request_line, serving, upload, wait_for, wait_status
from tests.integration.test_metrics import scrape
from tests.online_double import CHAT_EVENTS, DONE, USAGE, OnlineDouble, answer_for, chunk, usage_chunk

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/v1/responses": {"model": MODEL, "input": "hi"},
}


@pytest.fixture
def double(engine_service: EngineService) -> OnlineDouble:
    stand_in = OnlineDouble()
    engine_service.respond = stand_in.respond  # type: ignore[method-assign]
    return stand_in


@pytest.fixture
def online(client: TestClient, double: OnlineDouble) -> TestClient:
    wait_for(lambda: client.get("/v1/models").json()["data"])  # the fake engine has started
    return client


def test_each_endpoint_answers_with_the_engines_json(online, double, caplog):
    caplog.set_level(logging.INFO, "vbatch.access")
    for endpoint in ONLINE_ENDPOINTS:
        response = online.post(endpoint, json=BODIES[endpoint], headers={"x-request-id": f"req-{endpoint[4:7]}"})
        assert response.status_code == 200, response.text
        # As the engine answered, with the tier it was served on where OpenAI's answers say it.
        tier = {"service_tier": "default"} if endpoint in ("/v1/chat/completions", "/v1/responses") else {}
        assert response.json() == {**answer_for(endpoint, double.usage), **tier}
        assert response.headers["x-request-id"] == f"req-{endpoint[4:7]}"
        assert double.calls[-1] == (endpoint, BODIES[endpoint])
    assert not any(name.startswith("x-ratelimit") for name in response.headers)  # no limits set
    assert len(double.calls) == len(ONLINE_ENDPOINTS)
    logged = [(r.path, r.status, r.request_id) for r in caplog.records if r.name == "vbatch.access"]  # type: ignore[attr-defined]
    assert ("/v1/responses", 200, "req-res") in logged


def _events(stream: bytes) -> list[dict | str]:
    """Each event's data, parsed (`[DONE]` as it is)."""
    lines = [event.removeprefix(b"data: ") for event in stream.split(b"\n\n") if event]
    return [json.loads(line) if line != b"[DONE]" else "[DONE]" for line in lines]


def test_a_stream_passes_through_as_event_stream_in_openais_words(online, double):
    """Every chunk as the engine sent it, with the tier it was served on; the usage chunk vbatch asks of the engine
    (to charge what a stream generated) is left out for a client that did not ask for it, as OpenAI leaves it out."""
    double.events = [*CHAT_EVENTS[:-1], usage_chunk({"prompt_tokens": 5, "completion_tokens": 3}), DONE]
    with online.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "service_tier": "flex"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        received = _events(b"".join(response.iter_bytes()))
    sent = _events(b"".join(CHAT_EVENTS[:-1]))
    assert received == [{**event, "service_tier": "flex"} for event in sent] + ["[DONE]"]  # type: ignore[dict-item]
    assert double.closed.is_set()


def test_a_stream_that_asks_its_usage_has_a_null_usage_on_each_chunk_before_it(online, double):
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    double.events = [*CHAT_EVENTS[:-1], usage_chunk(usage), DONE]
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with online.stream("POST", "/v1/chat/completions", json=body) as response:
        received = _events(b"".join(response.iter_bytes()))
    *chunks, last, done = received
    assert done == "[DONE]" and len(chunks) == len(CHAT_EVENTS) - 1
    assert all(isinstance(c, dict) and c["usage"] is None and c["service_tier"] == "default" for c in chunks)
    assert isinstance(last, dict) and last["usage"] == usage and last["choices"] == []


def test_an_unknown_model_is_openais_404(online, double):
    response = online.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert double.calls == []


def test_a_body_that_is_not_a_json_object_gets_openais_400(online, double):
    # What OpenAI and vbatch's own routes answer such a body: `invalid_json`, never vLLM's `"code": 400`.
    invalid = online.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert invalid.status_code == 400
    assert invalid.json() == {
        "error": {
            "message": "We could not parse the JSON body of your request.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_json",
        }
    }
    a_list = online.post("/v1/completions", content=b"[1,2]", headers={"content-type": "application/json"})
    assert a_list.json()["error"] == {
        "message": "The body of your request must be a JSON object.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }
    assert double.calls == []


def test_an_engine_not_serving_yet_is_503_with_retry_after(online, double):
    double.unavailable = "starting"
    response = online.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert "starting" in response.json()["error"]["message"]
    assert int(response.headers["retry-after"]) > 0


def test_an_unknown_service_tier_is_refused_before_the_engine(online, double):
    response = online.post("/v1/chat/completions", json={**CHAT, "service_tier": "ultra"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "service_tier"
    assert double.calls == []


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"", "application/json"),
        (b"null", "application/json"),
        (b'"text"', "application/json"),
        (b"12", "application/json"),
        (b"\xff\xfe\x00", "application/json"),
        (b"[" * 100_000, "application/json"),
        (b'{"n": ' + b"1" * 5000 + b"}", "application/json"),
        (b'{"model": "\\ud800"}', "application/json"),
        (b'{"model": 5, "max_tokens": "many", "n": 1e400, "messages": {"a": [1, true, null]}}', "application/json"),
        (b'{"service_tier": ["priority"]}', "application/json"),
        (json.dumps(CHAT).encode(), "text/plain"),
        (json.dumps(CHAT).encode(), None),
        (json.dumps(CHAT).encode(), "application/json; charset=utf-8, garbage/=="),
    ],
)
def test_malformed_bodies_get_an_error_envelope_never_a_500(online, double, content, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = online.post("/v1/chat/completions", content=content, headers=headers)
    assert 400 <= response.status_code < 500 or response.status_code == 200, response.text
    if response.status_code != 200:  # a body the engine itself judges (the double answers anything)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_an_answer_that_echoes_a_lone_surrogate_still_goes_out(online, double):
    double.usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "note": "\ud800"}
    response = online.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.json()["usage"]["note"] == "\ud800"


# The routes in every role.


def test_a_worker_answers_online_requests_and_an_api_replica_says_when_no_worker_can(settings):
    worker_engine, double = EngineService(FakeEngine()), OnlineDouble()
    worker_engine.respond = double.respond  # type: ignore[method-assign]
    with TestClient(create_app(settings, worker_engine, Role.WORKER)) as worker:
        wait_for(lambda: worker.get("/v1/models").json()["data"])
        answered = worker.post("/v1/chat/completions", json=CHAT).json()
        assert answered == {**answer_for("/v1/chat/completions", USAGE), "service_tier": "default"}
    workers, nobody = WorkersView(), OnlineDouble()
    nobody.unavailable = "down"  # what the forwarder says with no worker to ask
    workers.respond = nobody.respond  # type: ignore[method-assign]
    with TestClient(create_app(settings, workers, Role.API)) as api:
        response = api.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    assert nobody.calls == [("/v1/chat/completions", CHAT)]  # no worker beats: no model to check it against


# A client that goes away, over real sockets.


@contextmanager
def served(settings: Settings, double: OnlineDouble, key: str = "") -> Iterator[int]:
    engine = EngineService(FakeEngine())
    engine.respond = double.respond  # type: ignore[method-assign]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with serving(create_app(settings, engine), free_port()) as port:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers).json()["data"])
        yield port


def _post(port: int, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return connection


def _read_until(connection: socket.socket, marker: bytes) -> bytes:
    received = b""
    connection.settimeout(20)
    while marker not in received:
        data = connection.recv(65536)
        assert data, received
        received += data
    return received


def test_a_client_gone_mid_stream_closes_the_engines_events(settings, tmp_path: Path):
    double = OnlineDouble()
    double.hold_after = 2  # two events, then the engine "generates" until the request is aborted
    with served(settings, double) as port:
        connection = _post(port, {**CHAT, "stream": True})
        received = _read_until(connection, b'"content":"Hel"')
        assert b"text/event-stream" in received and not double.closed.is_set()
        connection.close()
        wait_for(double.closed.is_set, timeout=10)
    assert double.sent == 2


def test_a_client_gone_before_a_json_answer_cancels_the_engines_call(settings):
    double = OnlineDouble()
    double.hold = True
    with served(settings, double) as port:
        connection = _post(port, CHAT)
        wait_for(lambda: double.calls)
        assert not double.cancelled.is_set()
        connection.close()
        wait_for(double.cancelled.is_set, timeout=10)


def test_the_openai_sdk_gets_answers_streamed_and_not(settings):
    double = OnlineDouble()
    with served(settings, double) as port:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert completion.choices[0].message.content == "Hello"
        assert completion.usage is not None and completion.usage.total_tokens == 7
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        assert "".join(part.choices[0].delta.content or "" for part in stream if part.choices) == "Hello"
        with pytest.raises(openai.NotFoundError) as unknown:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert unknown.value.code == "model_not_found"
    assert [call[1].get("stream") for call in double.calls] == [None, True]


# Per-key limits.


@pytest.fixture
def limited(settings: Settings, tmp_path: Path, engine_service: EngineService, double: OnlineDouble):
    keys = tmp_path / "keys"
    keys.write_text("sk-alice live_rpm=3\nsk-bob live_tpm=1000\nsk-carol\n")
    settings.api_keys_file = keys
    settings.live_rpm = 100  # the service's: carol's, and bob's requests
    with TestClient(create_app(settings, engine_service)) as client:
        client.app.state.online_limits.clock = lambda: 1000.0  # time stands still: no refill between requests
        wait_for(lambda: _as(client, "sk-carol").get("/v1/models").json()["data"])
        yield client


def _as(client: TestClient, key: str) -> TestClient:
    client.headers["authorization"] = f"Bearer {key}"
    return client


def test_requests_a_minute_count_down_then_429_and_other_keys_go_on(limited):
    seen = []
    for _ in range(3):
        response = _as(limited, "sk-alice").post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        seen.append({name: value for name, value in response.headers.items() if name.startswith("x-ratelimit")})
    assert [headers["x-ratelimit-remaining-requests"] for headers in seen] == ["2", "1", "0"]
    assert {headers["x-ratelimit-limit-requests"] for headers in seen} == {"3"}
    assert seen[-1]["x-ratelimit-reset-requests"] == "1m0s"  # 3 a minute: full again in 60 s
    assert seen[0]["x-ratelimit-reset-requests"] == "20s"
    assert "x-ratelimit-limit-tokens" not in seen[-1]  # alice has no token limit
    refused = _as(limited, "sk-alice").post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
    assert error["message"].startswith(f"Rate limit reached for {MODEL} on requests per min (RPM)")
    assert "Limit 3, Used 3, Requested 1" in error["message"]
    assert refused.headers["retry-after"] == "20"  # a request comes back every 20 s
    assert refused.headers["retry-after-ms"] == "20000"
    assert "Please try again in 20s." in error["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    carol = _as(limited, "sk-carol").post("/v1/chat/completions", json=CHAT)
    assert carol.status_code == 200 and carol.headers["x-ratelimit-remaining-requests"] == "99"


def test_a_worker_charges_no_limit_again_for_what_a_replica_forwarded(settings, tmp_path, double):
    keys = tmp_path / "keys"
    keys.write_text("sk-alice live_rpm=1\n")
    settings.api_keys_file = keys
    worker_engine = EngineService(FakeEngine())
    worker_engine.respond = double.respond  # type: ignore[method-assign]
    with TestClient(create_app(settings, worker_engine, Role.WORKER)) as worker:
        wait_for(lambda: _as(worker, "sk-alice").get("/v1/models").json()["data"])
        answers = [_as(worker, "sk-alice").post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert not any(name.startswith("x-ratelimit") for name in answers[-1].headers)


def test_tokens_a_minute_are_charged_the_estimate_then_the_real_usage(limited, double):
    bob = _as(limited, "sk-bob")
    # "hi" is a token; 300 the most it may generate; the answer's usage says 7 in all.
    response = bob.post("/v1/chat/completions", json={**CHAT, "max_tokens": 300})
    assert response.status_code == 200
    assert response.headers["x-ratelimit-limit-tokens"] == "1000"
    assert response.headers["x-ratelimit-remaining-tokens"] == "993"
    too_large = bob.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000})
    assert too_large.status_code == 429 and too_large.json()["error"]["type"] == "tokens"
    assert too_large.json()["error"]["message"].startswith("Request too large")
    assert too_large.headers["x-should-retry"] == "false" and "retry-after" not in too_large.headers
    double.usage = {"prompt_tokens": 1, "completion_tokens": 900, "total_tokens": 901}
    assert bob.post("/v1/chat/completions", json={**CHAT, "max_tokens": 900}).status_code == 200
    over = bob.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    # 92 left, 102 asked: 10 tokens come back in 0.6 s at 1,000 a minute.
    assert over.headers["retry-after-ms"] == "600" and over.headers["retry-after"] == "1"
    assert len(double.calls) == 2


def test_a_stream_is_charged_its_estimate_then_the_usage_it_reports(limited, double):
    double.events = [
        chunk("", role="assistant"),
        chunk("Hi"),
        usage_chunk({"prompt_tokens": 5, "completion_tokens": 3}),
        DONE,
    ]
    bob = _as(limited, "sk-bob")
    with bob.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.headers["x-ratelimit-remaining-tokens"] == "742"  # 2 for the prompt, 256 for no max_tokens
        b"".join(response.iter_bytes())
    # 8 for the stream, then 2 charged and 7 used by this one.
    assert (
        bob.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}).headers["x-ratelimit-remaining-tokens"]
        == "985"
    )


def test_streams_and_refusals_carry_the_headers_and_a_key_out_of_requests_still_runs_batches(limited, double):
    alice = _as(limited, "sk-alice")
    with alice.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.headers["x-ratelimit-remaining-requests"] == "2"
        b"".join(response.iter_bytes())
    # A name that is no model counts as a request: naming one again and again does not slip past the limit.
    unknown = alice.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert unknown.status_code == 404 and unknown.headers["x-ratelimit-remaining-requests"] == "1"
    assert alice.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert alice.post("/v1/chat/completions", json=CHAT).status_code == 429
    batch = create_batch(alice, upload(alice, jsonl([request_line(f"r{i}") for i in range(5)]))["id"])
    assert wait_status(alice, batch["id"], FINAL)["request_counts"] == {"total": 5, "completed": 5, "failed": 0}


def test_the_sdk_reads_the_limit_headers_and_raises_on_429(settings, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-dave live_rpm=1\n")
    settings.api_keys_file = keys
    with served(settings, OnlineDouble(), key="sk-dave") as port:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-dave", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT["messages"])
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=CHAT["messages"])
        assert refused.value.code == "rate_limit_exceeded"


# The series.


def test_the_live_series_count_each_key_and_model_and_time_streams(limited, double):
    double.events = [chunk("", role="assistant"), chunk("Hel"), chunk("lo"), DONE]
    carol = _as(limited, "sk-carol")
    assert carol.post("/v1/chat/completions", json=CHAT).status_code == 200
    with carol.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        b"".join(response.iter_bytes())
    assert carol.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
    seen = scrape(carol)
    owner = _owner("sk-carol")
    ok = (("endpoint", "/v1/chat/completions"), ("key", owner), ("model", MODEL), ("status", "200"))
    assert seen[("vbatch_live_requests_total", ok)] == 2
    unknown = (("endpoint", "/v1/chat/completions"), ("key", owner), ("model", "unknown"), ("status", "404"))
    assert seen[("vbatch_live_requests_total", unknown)] == 1
    by_key = (("key", owner), ("model", MODEL))
    assert seen[("vbatch_live_request_seconds_count", by_key)] == 2
    assert seen[("vbatch_live_time_to_first_token_seconds_count", by_key)] == 1
    assert seen[("vbatch_live_inter_token_latency_seconds_count", by_key)] == 2  # three output events
    others = scrape(_as(limited, "sk-alice"))
    assert not [name for name, labels in others if dict(labels).get("key") == owner]


def _owner(key: str) -> str:
    from app.core.auth import owner_of

    return owner_of(key)


def test_the_engine_page_shows_online_rates_beside_the_batches(online, double):
    for _ in range(3):
        assert online.post("/v1/chat/completions", json=CHAT).status_code == 200
    page = online.get("/console/engine").text
    online_row = page[page.index('id="online-rates"') :].split("</tr>")[0]
    # Three answers in the last 10 s, each of 2 output tokens (their usage).
    assert "<td>0.3</td><td>0.6</td>" in online_row.replace("\n", "").replace(" ", "")
    assert "Batches (0 running)" in page


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_the_engine_cannot_finish_ends_as_vllm_ends_one(client, endpoint):
    """An error event, then `[DONE]`, as vLLM's chat and completions generators send one after an error (a Responses
    stream has none; the fake streams only these two)."""
    wait_for(lambda: client.get("/v1/models").json()["data"])
    body = {**BODIES[endpoint], "stream": True, "stream_dies": True}
    with client.stream("POST", endpoint, json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    assert sum(event == "data: [DONE]" for event in events) == 1


def test_a_max_tokens_of_another_type_is_no_500(client):
    wait_for(lambda: client.get("/v1/models").json()["data"])
    for value in ("100", None):
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": value}).status_code == 200
