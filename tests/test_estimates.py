"""`POST /v1/batches/estimate` (issue 31): the arithmetic of `app.domain.estimates`, and the route over the fake
engine, whose tokenizer counts words (`app.testing.fake_token_count`). The real engine's counts are checked against
a batch's real usage in tests/e2e/test_estimate.py."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

import pytest
from fastapi.testclient import TestClient

from app.domain import estimates
from app.domain.input_index import PREFIX_CHARS
from app.engine import frontends
from app.engine.service import EngineService
from app.main import create_app
from app.testing import fake_frontends, fake_token_count
from tests.helpers import create_batch, jsonl, request_line, upload, wait_for, wait_status

CHAT = "/v1/chat/completions"

# The arithmetic.


def test_max_output_tokens_takes_the_line_limit_vllm_reads():
    assert estimates.max_output_tokens(CHAT, {"max_completion_tokens": 7, "max_tokens": 50}, 10, 2048) == 7
    assert estimates.max_output_tokens(CHAT, {"max_tokens": 50, "n": 3}, 10, 2048) == 150
    # No limit: the context left after the prompt; a limit past it is cut to it.
    assert estimates.max_output_tokens(CHAT, {}, 48, 2048) == 2000
    assert estimates.max_output_tokens(CHAT, {"max_tokens": 5000}, 48, 2048) == 2000
    assert estimates.max_output_tokens("/v1/completions", {}, 10, 2048) == 16  # vLLM's default for completions
    assert estimates.max_output_tokens("/v1/embeddings", {"max_tokens": 9}, 10, 2048) == 0


def test_lines_sharing_a_long_prefix_expect_it_cached_after_the_first():
    shared = "x" * PREFIX_CHARS
    bodies = [{"prompt": shared + " one"}, {"prompt": shared + " two"}, {"prompt": shared + " three"}]
    lines = [estimates.line_of("/v1/completions", body, 400, 2048) for body in bodies]
    lines.append(estimates.line_of("/v1/completions", {"prompt": "short"}, 3, 2048))
    # The second and third: the shared characters' part of their 400 tokens.
    expected = sum(400 * PREFIX_CHARS // len(body["prompt"]) for body in bodies[1:])
    assert estimates.expected_cached_tokens(lines) == expected
    assert 0 < expected < 800


def test_without_history_the_rate_is_unknown_and_nothing_is_priced():
    lines = [estimates.line_of(CHAT, {"max_tokens": 10}, 20, 2048)] * 4
    history = estimates.history_of([])
    found = estimates.estimate(
        estimates.Asked("file-1", CHAT, "m"), 4, lines, history, estimates.Pricing(gpus=1, gpu_hour_price=2.0)
    )
    assert (found.prompt_tokens, found.max_output_tokens) == (80, 40)
    assert found.expected_output_tokens is None and found.eta_seconds is None and found.cost_usd is None
    assert found.basis.rate == "unknown" and found.basis.history_batch_ids == []


def test_with_history_output_and_eta_follow_it_and_the_price_gives_a_cost():
    history = estimates.History(["b1", "b2"], lines=10, input_tokens=500, output_tokens=300, run_seconds=6.0)
    lines = [estimates.line_of(CHAT, {}, 20, 2048)] * 20
    pricing = estimates.Pricing(gpus=2, gpu_hour_price=3.6)
    found = estimates.estimate(estimates.Asked("file-1", CHAT, "m"), 20, lines, history, pricing)
    assert found.expected_output_tokens == 600  # 30 a line
    assert found.basis.tokens_per_second == 50.0 and found.basis.rate_unit == "output_tokens"
    assert found.eta_seconds == pytest.approx(12.0)
    assert found.gpu_seconds == pytest.approx(24.0)  # two GPUs
    assert found.cost_usd == pytest.approx(24.0 / 3600 * 3.6)
    unpriced = estimates.estimate(estimates.Asked("file-1", CHAT, "m"), 20, lines, history, estimates.Pricing(1, None))
    assert unpriced.cost_usd is None and unpriced.gpu_seconds == pytest.approx(12.0)


def test_embeddings_are_timed_by_their_input_tokens():
    history = estimates.History(["b1"], lines=10, input_tokens=1000, output_tokens=0, run_seconds=2.0)
    lines = [estimates.line_of("/v1/embeddings", {"input": "a b"}, 50, 2048)] * 10
    found = estimates.estimate(
        estimates.Asked("f", "/v1/embeddings", "m"), 10, lines, history, estimates.Pricing(1, None)
    )
    assert found.expected_output_tokens == 0 and found.basis.rate_unit == "input_tokens"
    assert found.eta_seconds == pytest.approx(1.0)


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

    async def count() -> list[int | None]:
        async with fake_frontends(2) as pool:
            return await pool.count_tokens(CHAT, bodies)

    assert asyncio.run(count()) == [*range(10), None]


def test_a_worker_view_says_token_counts_are_unknown():
    from app.engine.view import WorkersView

    with contextlib.closing(asyncio.new_event_loop()) as loop:
        assert loop.run_until_complete(WorkersView().count_tokens(CHAT, [{"prompt": "a"}])) is None


@pytest.mark.parametrize(
    ("endpoint", "body", "texts"),
    [
        ("/v1/score", {"text_1": "q", "text_2": ["a", "b"]}, ["q", "a", "q", "b"]),
        ("/v1/score", {"queries": "q", "documents": "a"}, ["q", "a"]),
        ("/v1/score", {"queries": ["q", "r"], "items": ["a", "b"]}, ["q", "a", "r", "b"]),
        ("/v1/score", {"data_1": ["q", "r"], "data_2": ["a", "b", "c"]}, None),  # N to M: the handler refuses it
        ("/v1/score", {"text_1": "q", "text_2": [{"type": "image_url"}]}, None),  # not text
        ("/v1/score", {"text_1": "q"}, None),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, ["q", "a", "q", "b"]),
        ("/v1/rerank", {"query": "q", "documents": []}, None),
    ],
)
def test_a_scoring_line_puts_each_pairs_two_texts_before_the_model(endpoint, body, texts):
    assert estimates.scored_texts(endpoint, body) == texts


def test_scoring_expects_no_output_and_is_timed_by_its_input_tokens():
    for endpoint in estimates.SCORING:
        assert estimates.max_output_tokens(endpoint, {"max_tokens": 5}, 10, 100) == 0
        history = estimates.History(["batch_s"], lines=10, input_tokens=400, output_tokens=0, run_seconds=4.0)
        lines = [estimates.line_of(endpoint, {}, 40, 100)] * 10
        answer = estimates.estimate(
            estimates.Asked("file-1", endpoint, "m"), 10, lines, history, estimates.Pricing(1, None)
        )
        assert (answer.expected_output_tokens, answer.eta_seconds, answer.basis.rate_unit) == (0, 4.0, "input_tokens")


def test_the_estimate_and_retry_answer_post_only_with_a_405_saying_so(client):
    for path in ("/v1/batches/estimate", "/v1/batches/batch_abc/retry"):
        for method in ("GET", "DELETE"):
            answer = client.request(method, path)
            assert answer.status_code == 405, (method, path, answer.text)
            assert answer.headers["allow"] == "POST"
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert client.get("/v1/batches/batch_abc").status_code == 404  # the batch route is untouched
