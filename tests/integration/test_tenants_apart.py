"""Tenants apart on one engine (issue 37), with the fake engine: the prefix cache's salt each request reaches the
engine with, online and in batches; limits charged on what the engine will run; names that are no model; the
adapters' server paths. The real engine's cache, and its limits, are shown in tests/e2e/test_tenants_apart_e2e.py."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest
from fastapi.testclient import TestClient

from app.core.auth import owner_of
from app.core.config import Settings
from app.core.lora_dir import LoraDir
from app.domain.prefix_cache import tenant_salted
from app.domain.ratelimits import RateLimiter
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine
from tests.helpers import MODEL, create_batch, jsonl, request_line, upload, wait_for, wait_status
from tests.online_double import OnlineDouble, usage_chunk

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the same words from both"}]}


def as_key(client: TestClient, key: str) -> TestClient:
    client.headers["Authorization"] = f"Bearer {key}"
    return client


def keyed(settings: Settings, **more) -> Settings:
    return settings.model_copy(update={"api_keys": f"{KEY_A},{KEY_B}", **more})


# The salt.


def test_each_tenant_has_a_salt_of_its_own_and_the_callers_salt_is_folded_in_never_replacing_it():
    a, b = owner_of(KEY_A), owner_of(KEY_B)
    salt_of = {name: tenant_salted(body, owner)["cache_salt"] for name, body, owner in [
        ("a", {}, a), ("a again", {"x": 1}, a), ("b", {}, b),
        ("a, own", {"cache_salt": "mine"}, a), ("b, same own", {"cache_salt": "mine"}, b),
    ]}  # fmt: skip
    assert salt_of["a"] == salt_of["a again"]  # one tenant's requests share their prefixes
    assert len(set(salt_of.values())) == 4  # all else apart: the caller's own salt cannot name another tenant's
    assert all(len(salt) == 64 and salt.isalnum() for salt in salt_of.values())  # a salt vLLM takes
    # vLLM's own rule for a caller's salt stands: one it refuses goes to it as sent, to be refused.
    for refused in ("", "a/b", "x" * 129, 5):
        assert tenant_salted({"cache_salt": refused}, a) == {"cache_salt": refused}
    assert tenant_salted({"cache_salt": "mine"}, "") == {"cache_salt": "mine"}  # no keys: one tenant, nothing apart


def engine_salts(engine: FakeEngine) -> list[object]:
    return [body.get("cache_salt") for body in engine.executor.bodies]


def test_online_requests_and_batch_lines_reach_the_engine_salted_by_their_tenant(settings):
    engine = FakeEngine()
    with TestClient(create_app(keyed(settings), EngineService(engine))) as client:
        wait_for(lambda: as_key(client, KEY_A).get("/v1/models").json()["data"])
        for key in (KEY_A, KEY_B, KEY_A):
            assert as_key(client, key).post("/v1/chat/completions", json=CHAT).status_code == 200
        online_a, online_b, online_a_again = engine_salts(engine)
        assert online_a == online_a_again and online_a != online_b and isinstance(online_a, str)
        lines = [request_line(f"r{n}", messages=CHAT["messages"]) for n in range(3)]
        batch = create_batch(as_key(client, KEY_B), upload(client, jsonl(lines))["id"])
        wait_status(client, batch["id"], {"completed"})
    assert engine_salts(engine)[3:] == [online_b] * 3  # the batch shares its prefixes with its own key's requests


def test_a_shared_cache_leaves_every_salt_as_the_caller_sent_it(settings):
    engine = FakeEngine()
    with TestClient(create_app(keyed(settings, shared_prefix_cache=True), EngineService(engine))) as client:
        wait_for(lambda: as_key(client, KEY_A).get("/v1/models").json()["data"])
        assert as_key(client, KEY_A).post("/v1/chat/completions", json=CHAT).status_code == 200
        own = {**CHAT, "cache_salt": "mine"}
        assert as_key(client, KEY_B).post("/v1/chat/completions", json=own).status_code == 200
        batch = create_batch(client, upload(client, jsonl([request_line("r", messages=CHAT["messages"])]))["id"])
        wait_status(client, batch["id"], {"completed"})
    assert engine_salts(engine) == [None, "mine", None]


# Limits charged on what the engine will run.


@pytest.fixture
def limited(settings: Settings, engine_service: EngineService) -> tuple[TestClient, OnlineDouble]:
    double = OnlineDouble()
    engine_service.respond = double.respond  # type: ignore[method-assign]
    app = create_app(keyed(settings, live_rpm=3, live_tpm=1000), engine_service)
    with TestClient(app) as client:
        wait_for(lambda: as_key(client, KEY_A).get("/v1/models").json()["data"])
        yield client, double


def test_online_n_has_the_bound_of_batch_lines_and_nothing_is_charged_for_it(limited):
    client, double = limited
    for n in (1000, "129", 129.0):
        refused = as_key(client, KEY_A).post("/v1/chat/completions", json={**CHAT, "n": n})
        assert refused.status_code == 400
        assert refused.json()["error"] | {"message": ""} == {
            "message": "", "type": "invalid_request_error", "param": "n", "code": "invalid_value"
        }  # fmt: skip
    assert double.calls == []
    assert (
        as_key(client, KEY_A).post("/v1/chat/completions", json={**CHAT, "n": "128", "max_tokens": 1}).status_code
        == 200
    )


def test_a_charge_read_as_the_engine_reads_the_body_is_refused_past_the_limit(limited):
    """`max_tokens` as a string was charged as unset (256): six streams of "700" generated 4,200 tokens in 81 s
    under a limit of 1,000 a minute."""
    client, double = limited
    refused = as_key(client, KEY_A).post("/v1/chat/completions", json={**CHAT, "max_tokens": "1200"})
    assert refused.status_code == 429 and "Requested 12" in refused.json()["error"]["message"]  # 1,200 and the prompt
    assert double.calls == []
    first = as_key(client, KEY_A).post(
        "/v1/completions", json={"model": MODEL, "prompt": ["p"] * 4, "max_tokens": "200"}
    )
    assert first.status_code == 200  # charged 4 x 200 and the prompts
    assert int(first.headers["x-ratelimit-remaining-tokens"]) >= 1000 - 810 - 5  # settled at its usage, refills
    second = as_key(client, KEY_A).post(
        "/v1/completions", json={"model": MODEL, "prompt": ["p"] * 4, "max_tokens": 200}
    )
    assert second.status_code == 200


def test_a_stream_that_did_not_ask_its_usage_is_settled_with_what_it_generated(limited):
    """A stream without `include_usage` was never settled: it kept its charge, and one that ran past it was free."""
    client, double = limited
    usage = {"prompt_tokens": 5, "completion_tokens": 900, "total_tokens": 905}
    double.events = [usage_chunk(usage), b"data: [DONE]\n\n"]  # the usage vbatch asks of the engine for every stream
    with as_key(client, KEY_A).stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 10}
    ) as response:
        assert b"".join(response.iter_bytes()) == b"data: [DONE]\n\n"  # not asked for: not shown
    after = as_key(client, KEY_A).post("/v1/chat/completions", json={**CHAT, "max_tokens": 200})
    # 905 used of 1,000 (and a little refilled): the next request is refused, not let in on the stream's charge of 16.
    assert after.status_code == 429


def test_a_name_that_is_no_model_is_charged_and_looked_up_once_a_while(settings, engine_service, tmp_path, monkeypatch):
    folder = tmp_path / "adapters"
    folder.mkdir()
    looked_up: list[str] = []
    has = LoraDir.has
    monkeypatch.setattr(LoraDir, "has", lambda self, name: looked_up.append(name) or has(self, name))
    app = create_app(keyed(settings, live_rpm=3, lora_dir=str(folder)), engine_service)
    with TestClient(app) as client:
        wait_for(lambda: as_key(client, KEY_A).get("/v1/models").json()["data"])
        statuses = [
            as_key(client, KEY_A).post("/v1/chat/completions", json={**CHAT, "model": "no-such"}).status_code
            for _ in range(5)
        ]
    assert statuses == [404, 404, 404, 429, 429]  # the limit runs before the model is looked up
    assert looked_up == ["no-such"]  # and a name found to be none is remembered


def test_a_limits_headers_count_the_request_they_answer_however_long_it_ran():
    now = [0.0]
    limiter = RateLimiter.from_settings(rpm=60, tpm=6000, key_settings={})
    limiter.clock = lambda: now[0]
    admission = limiter.admit("alice", tokens=100, model=MODEL)
    assert admission.quota.requests is not None and admission.quota.requests.remaining == 59
    now[0] = 30.0  # a long answer: the requests bucket has refilled meanwhile
    quota = limiter.settle(admission, tokens_used=40)
    assert quota.requests is not None and quota.requests.remaining == 59
    assert quota.tokens is not None and quota.tokens.remaining == 6000  # 60 back, and refilled to the top


# What a tenant sees of the server.


def test_models_lists_adapters_without_the_servers_paths(settings):
    engine = FakeEngine(adapters=["sql-lora"])  # loaded from /adapters/sql-lora
    with TestClient(create_app(keyed(settings), EngineService(engine))) as client:
        wait_for(lambda: len(as_key(client, KEY_B).get("/v1/models").json()["data"]) == 2)
        listed = as_key(client, KEY_B).get("/v1/models").json()["data"]
        card = as_key(client, KEY_B).get("/v1/models/sql-lora").json()
    assert card == {"id": "sql-lora", "object": "model", "created": card["created"], "owned_by": "vbatch",
                    "parent": MODEL}  # fmt: skip
    assert card in listed
    assert "/adapters" not in str(listed) + str(card)


# Estimates bounded.


def test_estimates_run_one_a_key_and_two_in_all_and_the_rest_are_refused_at_once(settings, engine_service, monkeypatch):
    import threading

    from app.api import batches as batch_routes

    release, started = threading.Event(), threading.Semaphore(0)

    estimate_now = batch_routes.estimating.estimate

    async def slow_estimate(**arguments: object) -> object:
        started.release()
        await asyncio.to_thread(release.wait, 30)
        return await estimate_now(**arguments)  # type: ignore[arg-type]

    monkeypatch.setattr(batch_routes.estimating, "estimate", slow_estimate)
    keys = f"{KEY_A},{KEY_B},sk-tenant-c-000000"
    app = create_app(settings.model_copy(update={"api_keys": keys}), engine_service)
    body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:

        def estimate(key: str) -> httpx.Response:
            return client.post("/v1/batches/estimate", json=body, headers={"Authorization": f"Bearer {key}"})

        running = [pool.submit(estimate, KEY_A), pool.submit(estimate, KEY_B)]
        for _ in running:
            assert started.acquire(timeout=30)
        refused = [estimate(KEY_A), estimate("sk-tenant-c-000000")]  # A's second; C's, past two in all
        release.set()
        answered = [future.result(timeout=30) for future in running]
        again = estimate(KEY_A)
    assert [response.status_code for response in answered] == [404, 404]  # answered: there is no such file
    assert again.status_code == 404  # the slots are free again
    for response, whose in zip(refused, ("of this API key", "of all keys"), strict=True):
        assert response.status_code == 429 and response.headers["retry-after"] == "5"
        assert response.json()["error"]["code"] == "too_many_estimates" and whose in response.json()["error"]["message"]
