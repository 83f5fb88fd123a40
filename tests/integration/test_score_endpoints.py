"""Score and rerank batches (issue 31: every endpoint `vllm run-batch` accepts) over the fake engine: the endpoints
are accepted at creation, their lines run and count their prompt tokens, and an engine whose model cannot answer
the endpoint gives each line an error of its own. The real serving layer's side: its handlers for a scoring model,
under the routes `vllm serve` has, validating bodies as `vllm run-batch` does. tests/e2e/test_score.py runs them on
the real CPU engine with a cross-encoder."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.datastructures import State

from app.domain.batches import ENDPOINTS
from app.domain.estimates import SCORING
from app.engine.inference.vllm_adapter import ServingLayer
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FAKE_MODEL, FAKE_PAIR_TOKENS, FakeEngine
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_status

DOCUMENTS = ["Paris is in France.", "Bananas are yellow.", "The Louvre is a museum in Paris."]


def score_line(custom_id: str, documents: list[str] = DOCUMENTS) -> dict:
    body = {"model": FAKE_MODEL, "text_1": "Where is Paris?", "text_2": documents}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/score", "body": body}


def rerank_line(custom_id: str, top_n: int | None = None) -> dict:
    body = {"model": FAKE_MODEL, "query": "Where is Paris?", "documents": DOCUMENTS}
    if top_n is not None:
        body["top_n"] = top_n
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/rerank", "body": body}


def ended(client, lines: list[dict], endpoint: str) -> dict:
    batch = create_batch(client, upload(client, jsonl(lines))["id"], endpoint=endpoint)
    assert batch["endpoint"] == endpoint
    return wait_status(client, batch["id"], {"completed", "failed"})


@pytest.fixture
def fake_engine() -> FakeEngine:
    """An engine serving a model that scores (a cross-encoder): it answers score and rerank, and nothing else."""
    return FakeEngine(endpoints=SCORING)


def test_score_and_rerank_are_batch_endpoints_and_audio_is_refused_at_creation(client):
    assert {"/v1/score", "/v1/rerank"} <= set(ENDPOINTS)
    file_id = upload(client, jsonl([score_line("s0")]))["id"]
    for endpoint in ("/v1/score", "/v1/rerank"):
        assert create_batch(client, file_id, endpoint=endpoint)["endpoint"] == endpoint
    refused = client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/audio/transcriptions", "completion_window": "24h"},
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "endpoint" and error["code"] == "invalid_value"
    assert "/v1/score" in error["message"] and "/v1/rerank" in error["message"]


@pytest.mark.both_backends
def test_a_score_batch_answers_each_line_with_a_score_per_document_and_counts_its_prompt_tokens(client):
    lines = [score_line("s0"), score_line("s1", DOCUMENTS[:2]), score_line("s2", DOCUMENTS[:1])]
    done = ended(client, lines, "/v1/score")
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    outputs = {row["custom_id"]: row for row in read_jsonl(client, done["output_file_id"])}
    assert set(outputs) == {"s0", "s1", "s2"}
    for line in lines:
        row = outputs[line["custom_id"]]
        assert row["response"]["status_code"] == 200 and row["error"] is None
        body = row["response"]["body"]
        assert body["object"] == "list" and body["model"] == FAKE_MODEL
        assert [item["index"] for item in body["data"]] == list(range(len(line["body"]["text_2"])))
    documents = sum(len(line["body"]["text_2"]) for line in lines)
    assert done["usage"]["input_tokens"] == FAKE_PAIR_TOKENS * documents
    assert done["usage"]["output_tokens"] == 0
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"]


def test_a_rerank_batch_answers_each_line_with_its_documents_ranked(client, fake_engine):
    done = ended(client, [rerank_line("r0"), rerank_line("r1", top_n=2)], "/v1/rerank")
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2
    outputs = {row["custom_id"]: row["response"]["body"] for row in read_jsonl(client, done["output_file_id"])}
    for custom_id, count in (("r0", 3), ("r1", 2)):
        results = outputs[custom_id]["results"]
        assert len(results) == count
        scores = [result["relevance_score"] for result in results]
        assert scores == sorted(scores, reverse=True)
        assert all(result["document"]["text"] == DOCUMENTS[result["index"]] for result in results)
    assert done["usage"]["input_tokens"] == FAKE_PAIR_TOKENS * 2 * len(DOCUMENTS)  # top_n ranks all, shows some
    assert sorted(body["top_n"] for body in fake_engine.executor.bodies if "top_n" in body) == [2]


def test_a_chat_batch_on_a_model_that_only_scores_gives_each_line_the_error(client, fake_engine):
    done = ended(client, [request_line("c0"), request_line("c1")], "/v1/chat/completions")
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert done["output_file_id"] is None
    errors = read_jsonl(client, done["error_file_id"])
    assert sorted(row["custom_id"] for row in errors) == ["c0", "c1"]
    for row in errors:
        assert row["response"]["status_code"] == 400
        message = row["response"]["body"]["error"]["message"]
        assert "cannot answer /v1/chat/completions" in message and "/v1/score" in message
    assert fake_engine.executor.bodies == []  # refused before the engine


def test_a_score_batch_on_a_generative_model_gives_each_line_the_error(settings):
    generative = FakeEngine()
    with TestClient(create_app(settings, EngineService(generative))) as client:
        done = ended(client, [score_line("s0"), score_line("s1")], "/v1/score")
        assert done["status"] == "completed" and done["request_counts"]["failed"] == 2
        for row in read_jsonl(client, done["error_file_id"]):
            assert row["response"]["status_code"] == 400
            assert "cannot answer /v1/score" in row["response"]["body"]["error"]["message"]
    assert generative.executor.bodies == []


# The real serving layer, over the state vLLM's `init_app_state` leaves for a scoring model.


async def _scores(request, raw_request=None):
    return request


def test_a_scoring_model_is_answered_under_every_route_vllm_serve_has_for_score_and_rerank():
    state = State()
    state.serving_scores = _scores
    handlers = ServingLayer._collect(state)
    assert set(handlers) == {"/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"}
    score = handlers["/v1/score"].request_type.model_validate({"model": "m", "text_1": "q", "text_2": ["a", "b"]})
    assert (score.data_1, score.data_2) == ("q", ["a", "b"])
    pairs = handlers["/score"].request_type.model_validate({"model": "m", "queries": "q", "documents": ["a"]})
    assert pairs.data_2 == ["a"]
    rerank = handlers["/v1/rerank"].request_type.model_validate({"model": "m", "query": "q", "documents": ["a"]})
    assert (rerank.query, rerank.top_n) == ("q", 0)
    with pytest.raises(ValidationError):
        handlers["/v1/rerank"].request_type.model_validate({"model": "m", "documents": ["a"]})


def test_a_generative_model_has_no_score_handlers():
    assert ServingLayer._collect(State()) == {}
