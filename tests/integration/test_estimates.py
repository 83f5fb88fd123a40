"""`POST /v1/batches/estimate` (issue 31): the arithmetic of `app.domain.estimates`, and the route over the fake
engine, whose tokenizer counts words (`app.testing.fake_token_count`). The real engine's counts are checked against
a batch's real usage in tests/e2e/test_estimate.py.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_estimates.py."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from fastapi.testclient import TestClient

from app.domain import estimates
from app.engine.inference import frontends
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FAKE_BLOCK_SIZE, fake_frontends, fake_token_count
from tests.helpers import create_batch, jsonl, request_line, upload, wait_for, wait_status

CHAT = "/v1/chat/completions"

# The arithmetic.


# Each line's own cap against the history's (issue 38): answers cut at a lower cap are a floor, not a figure.


# The route, over the fake engine.


def _file(client: TestClient, count: int, **body) -> tuple[str, list[dict]]:
    lines = [request_line(f"r{i}", **body) for i in range(count)]
    lines = [{**line, "body": {**line["body"], "messages": [{"role": "user", "content": "word " * (i + 1)}]}}
             for i, line in enumerate(lines)]  # fmt: skip
    return upload(client, jsonl(lines))["id"], lines


def _estimate(client: TestClient, file_id: str, **extra):
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **extra}
    return client.post("/v1/batches/estimate", json=body)


def _ready(client: TestClient) -> TestClient:
    wait_for(lambda: client.get("/health").status_code == 200)
    return client


def test_the_estimate_counts_with_the_engine_and_creates_nothing(client):
    _ready(client)
    file_id, lines = _file(client, 6, max_tokens=9)
    answer = _estimate(client, file_id)
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert found["object"] == "batch.estimate" and found["errors"] is None
    assert found["lines"] == 6
    assert found["prompt_tokens"] == sum(fake_token_count(line["body"]) for line in lines)
    assert found["max_output_tokens"] == 6 * 9
    assert found["basis"]["token_counts"] == "tokenizer"
    # No batch has run: no expected output, no ETA, and the basis says so.
    assert found["expected_output_tokens"] is None and found["eta_seconds"] is None
    assert found["basis"]["rate"] == "unknown" and found["cost_usd"] is None
    assert client.get("/v1/batches").json()["data"] == []


def test_lines_that_share_a_system_prompt_expect_it_cached_after_the_first(client):
    _ready(client)
    system = "you label support tickets by their topic"  # 7 words: one whole block of the fake's 4
    lines = [request_line(f"r{i}") for i in range(5)]
    for i, line in enumerate(lines):
        line["body"]["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": f"{i} ticket"}]
    found = _estimate(client, upload(client, jsonl(lines))["id"]).json()
    assert found["prompt_tokens"] == 5 * 9
    # Each after the first finds the block of 4 words they all begin with; the second block differs from line to line.
    assert found["expected_cached_tokens"] == 4 * FAKE_BLOCK_SIZE
    assert found["expected_cached_share"] == round(16 / 45, 4)


def test_after_a_batch_the_estimate_expects_what_it_did(client):
    _ready(client)
    file_id, _ = _file(client, 4)
    batch = create_batch(client, file_id)
    done = wait_status(client, batch["id"], {"completed"})
    progress = client.get(f"/v1/batches/{batch['id']}/progress").json()
    other_id, _ = _file(client, 8)
    found = _estimate(client, other_id).json()
    per_line = done["usage"]["output_tokens"] / done["request_counts"]["completed"]
    assert found["expected_output_tokens"] == round(per_line * 8)
    rate = done["usage"]["output_tokens"] / progress["timeline"]["last_result"]
    assert found["basis"]["rate"] == "measured" and found["basis"]["history_batch_ids"] == [batch["id"]]
    assert found["eta_seconds"] == pytest.approx(found["expected_output_tokens"] / rate, abs=1e-3)
    assert found["gpu_seconds"] == pytest.approx(found["eta_seconds"], abs=1e-3)
    assert found["cost_usd"] is None  # no price set


def _answers_that_run_to(fake_engine, natural: int) -> None:
    """The fake answers every line with `natural` output tokens, or its max_tokens where that is fewer, stopped
    there (finish_reason `length`), as a model whose answers all run that long."""
    answer = fake_engine.executor.execute

    async def execute(endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        status, answered = await answer(endpoint, body, rank)
        cap = body.get("max_tokens")
        tokens = min(natural, cap) if isinstance(cap, int) else natural
        choice = {**answered["choices"][0], "finish_reason": "length" if tokens < natural else "stop"}
        return status, {**answered, "choices": [choice], "usage": {**answered["usage"], "completion_tokens": tokens}}

    fake_engine.executor.execute = execute


def test_after_batches_cut_at_a_lower_cap_the_estimate_is_a_range_until_one_at_the_files_cap_has_run(
    client, fake_engine
):
    """The issue's case over the fake: answers of 10 tokens, three batches at max_tokens 4 (every answer cut), then a
    file at 16. The history says only that each line gives 4 to 16; the batch then gives 10 a line. Once it has run,
    it alone tells the file, to the token."""
    _ready(client)
    _answers_that_run_to(fake_engine, 10)
    for _ in range(3):
        wait_status(client, create_batch(client, _file(client, 5, max_tokens=4)[0])["id"], {"completed"})
    file_id, _ = _file(client, 20, max_tokens=16)
    before = _estimate(client, file_id).json()
    assert (before["expected_output_tokens_low"], before["expected_output_tokens"]) == (20 * 4, 20 * 10)
    assert before["expected_output_tokens_high"] == 20 * 16
    basis = before["basis"]
    assert (basis["output"], basis["history_lines"], basis["history_cut_lines"]) == ("range", 15, 15)
    assert "15 of the 15 answers" in basis["output_reason"]
    assert before["eta_seconds_low"] < before["eta_seconds"] < before["eta_seconds_high"]

    ran = wait_status(client, create_batch(client, file_id)["id"], {"completed"})
    actual = ran["usage"]["output_tokens"]
    assert actual == 20 * 10
    assert before["expected_output_tokens_low"] <= actual <= before["expected_output_tokens_high"]

    after = _estimate(client, file_id).json()
    assert after["basis"]["history_batch_ids"] == [ran["id"]]  # the batches cut at 4 tell this file nothing more
    assert (after["basis"]["output"], after["basis"]["output_reason"]) == ("measured", None)
    assert (
        after["expected_output_tokens_low"] == after["expected_output_tokens"] == after["expected_output_tokens_high"]
    )
    assert after["expected_output_tokens"] == actual


def test_with_a_price_the_estimate_has_a_cost(settings, engine_service):
    settings = settings.model_copy(update={"gpu_hour_price": 3.6})
    with TestClient(create_app(settings, engine_service)) as client:
        _ready(client)
        file_id, _ = _file(client, 3)
        wait_status(client, create_batch(client, file_id)["id"], {"completed"})
        found = _estimate(client, file_id).json()
    assert found["gpu_hour_price"] == 3.6
    assert found["cost_usd"] == pytest.approx(found["gpu_seconds"] / 1000, abs=1e-6)


def test_a_file_that_would_fail_validation_gets_validations_errors(client):
    _ready(client)
    good = request_line("a")
    content = jsonl([good, b"{not json", {**request_line("b"), "method": "GET"}, good])
    file_id = upload(client, content)["id"]
    found = _estimate(client, file_id).json()
    failed = wait_status(client, create_batch(client, file_id)["id"], {"failed"})
    assert found["errors"] == failed["errors"]
    assert [error["line"] for error in found["errors"]["data"]] == [2, 3, 4]
    assert found["prompt_tokens"] is None and found["lines"] == 4


def test_bad_requests_are_refused_as_creation_refuses_them(client):
    _ready(client)
    assert _estimate(client, "file-nope").json()["error"]["param"] == "input_file_id"
    assert _estimate(client, "file-nope").status_code == 404
    file_id, _ = _file(client, 1)
    for extra in ({"endpoint": "/v1/nope"}, {"completion_window": "1y"}):
        estimated = _estimate(client, file_id, **extra)
        created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT,
                                                   "completion_window": "24h", **extra})  # fmt: skip
        assert estimated.status_code == created.status_code == 400
        assert estimated.json() == created.json()
    assert client.get("/v1/batches").json()["data"] == []


@asynccontextmanager
async def _never_ready():
    await asyncio.Event().wait()
    yield


def test_an_engine_not_up_is_a_503(settings):
    with TestClient(create_app(settings, EngineService(_never_ready))) as client:
        file_id = upload(client, jsonl([request_line("a")]))["id"]
        answer = _estimate(client, file_id)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "engine_unavailable"


def test_front_end_processes_count_in_parts_and_keep_the_order(monkeypatch):
    monkeypatch.setattr(frontends, "COUNT_PART", 3)
    bodies = [{"messages": [{"role": "user", "content": "w " * i}]} for i in range(10)] + [{"prompt": 5}]

    async def count() -> list[estimates.PromptCount | None]:
        async with fake_frontends(2) as pool:
            return await pool.count_tokens(CHAT, bodies)

    counted = asyncio.run(count())
    assert [None if c is None else c.tokens for c in counted] == [*range(10), None]
    # Parts 0-2, 3-5, 6-8 and 9-10 are counted apart: a prompt finds cached only the whole blocks (4 words) that an
    # earlier prompt of its own part began with, short of its last word (6 words find nothing: 4 and 5 were counted
    # in another part).
    assert FAKE_BLOCK_SIZE == 4
    assert [c.cached for c in counted[:10]] == [0, 0, 0, 0, 0, 4, 0, 4, 4, 0]


def test_the_estimate_and_retry_answer_post_only_with_a_405_saying_so(client):
    for path in ("/v1/batches/estimate", "/v1/batches/batch_abc/retry"):
        for method in ("GET", "DELETE"):
            answer = client.request(method, path)
            assert answer.status_code == 405, (method, path, answer.text)
            assert answer.headers["allow"] == "POST"
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert client.get("/v1/batches/batch_abc").status_code == 404  # the batch route is untouched
