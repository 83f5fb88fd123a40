"""Score and rerank batches on the real CPU engine (issue 31: every endpoint `vllm run-batch` accepts). The test
session writes a tiny cross-encoder (a two-layer LlamaForSequenceClassification with one label and random weights,
beside SmolLM2's tokenizer): vLLM serves it as a pooling model that scores. Through the openai SDK a batch of
/v1/score lines and one of /v1/rerank lines are answered line by line in OpenAI's batch output shape, their prompt
tokens counted; a chat batch against it, which the model cannot answer, gives each line the error. The estimate of a
score file counts its pairs' tokens with the model's tokenizer, expects no output, and times it by input tokens."""

from __future__ import annotations

import io
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from app.engine.inference.vllm_adapter import is_cpu_build
from app.testing import VbatchServer, free_port
from tests.e2e.helpers import chat_line, lines_of, submit, to_jsonl, wait_terminal
from tests.schemas import validate

STARTUP_SECONDS = 900
SCORER = "tiny-scorer"
QUERY = "Where is the Eiffel Tower?"
DOCUMENTS = ["The Eiffel Tower is in Paris.", "Bananas are rich in potassium.", "Paris is the capital of France."]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_cross_encoder(folder: Path, tokenizer_from: Path) -> Path:
    """A cross-encoder vLLM scores with (`--convert classify` of Llama, chosen by its architecture): its scores need
    not make sense, only come from the model; heads of 64, which the CPU attention kernels take."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=49152,  # SmolLM2's tokenizer
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        num_labels=1,  # one score a pair: what vLLM's score API asks of a classifier
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).to(torch.bfloat16).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, model_path) -> Iterator[VbatchServer]:
    base = tmp_path_factory.mktemp("vbatch-score")
    model = write_cross_encoder(base / "model", model_path)
    flags = ["--model", str(model), "--served-model-name", SCORER, "--enforce-eager", "--max-model-len", "512"]
    if is_cpu_build():
        flags += ["--gpu-memory-utilization", "0.1"]
    env = {"VBATCH_MAX_IN_FLIGHT": "8", "VBATCH_PROGRESS_LOG_SECONDS": "2"}
    server = VbatchServer(base / "data", free_port(), flags, base / "serve.log", env=env)
    try:
        server.wait_ready(timeout=STARTUP_SECONDS)
        yield server
    finally:
        server.stop()
        log = (base / "serve.log").read_text(errors="replace")
        sys.stderr.write(f"\n--- last lines of the score server log ---\n{log[-4000:]}\n")


@pytest.fixture(scope="module")
def client(scorer) -> OpenAI:
    return OpenAI(base_url=f"{scorer.base_url}/v1", api_key="e2e", max_retries=0, timeout=120)


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": SCORER, **body}}


def answered(client: OpenAI, lines: list[dict], endpoint: str) -> tuple[object, dict[str, dict]]:
    """The ended batch and its output lines by custom_id, each in OpenAI's BatchRequestOutput shape."""
    done = wait_terminal(client, submit(client, lines, endpoint=endpoint).id)
    assert done.status == "completed" and done.endpoint == endpoint, done
    assert done.request_counts.completed == len(lines) and done.request_counts.failed == 0, done
    outputs = lines_of(client, done.output_file_id)
    for output in outputs:
        validate(output, "BatchRequestOutput", document=1)
        assert output["response"]["status_code"] == 200 and output["error"] is None
    return done, {output["custom_id"]: output["response"]["body"] for output in outputs}


def test_a_score_batch_scores_each_pair_of_each_line(client):
    lines = [
        line("s0", "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
        line("s1", "/v1/score", {"queries": QUERY, "documents": DOCUMENTS[:2]}),
    ]
    done, bodies = answered(client, lines, "/v1/score")
    assert set(bodies) == {"s0", "s1"}
    for custom_id, count in (("s0", 3), ("s1", 2)):
        body = bodies[custom_id]
        assert body["object"] == "list" and body["model"] == SCORER
        assert [item["index"] for item in body["data"]] == list(range(count))
        assert all(isinstance(item["score"], float) for item in body["data"])
    # The same pair scores the same on both lines, whatever spelling the line used.
    assert [item["score"] for item in bodies["s1"]["data"]] == [item["score"] for item in bodies["s0"]["data"][:2]]
    assert done.usage.input_tokens == sum(body["usage"]["prompt_tokens"] for body in bodies.values()) > 0
    assert done.usage.output_tokens == 0


def test_a_rerank_batch_ranks_the_documents_of_each_line(client):
    lines = [
        line("r0", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        line("r1", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}),
    ]
    done, bodies = answered(client, lines, "/v1/rerank")
    full, top = bodies["r0"]["results"], bodies["r1"]["results"]
    assert sorted(result["index"] for result in full) == [0, 1, 2]
    scores = [result["relevance_score"] for result in full]
    assert scores == sorted(scores, reverse=True)
    assert all(result["document"]["text"] == DOCUMENTS[result["index"]] for result in full)
    assert top == full[:1]
    assert done.usage.input_tokens == sum(body["usage"]["prompt_tokens"] for body in bodies.values()) > 0


def test_a_chat_batch_on_the_scoring_model_gives_each_line_the_error(client):
    lines = [chat_line("c0", "Hi") | {"body": {"model": SCORER, "messages": [{"role": "user", "content": "Hi"}]}}]
    lines.append(lines[0] | {"custom_id": "c1"})
    done = wait_terminal(client, submit(client, lines).id)
    assert done.status == "completed" and done.request_counts.failed == 2 and done.output_file_id is None
    errors = lines_of(client, done.error_file_id)
    assert sorted(error["custom_id"] for error in errors) == ["c0", "c1"]
    for error in errors:
        validate(error, "BatchRequestOutput", document=1)
        assert error["response"]["status_code"] == 400
        message = error["response"]["body"]["error"]["message"]
        assert "cannot answer /v1/chat/completions" in message and "/v1/score" in message


def _estimate(client: OpenAI, lines: list[dict], endpoint: str) -> tuple[str, dict]:
    uploaded = client.files.create(file=("score.jsonl", io.BytesIO(to_jsonl(lines))), purpose="batch")
    body = {"input_file_id": uploaded.id, "endpoint": endpoint, "completion_window": "24h"}
    return uploaded.id, client.post("/batches/estimate", body=body, cast_to=object)  # type: ignore[return-value]


def test_a_score_files_estimate_counts_its_pairs_and_is_timed_by_input_tokens_once_one_has_run(client):
    lines = [
        line("e0", "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
        line("e1", "/v1/score", {"data_1": [QUERY, QUERY], "data_2": DOCUMENTS[1:]}),
    ]
    file_id, before = _estimate(client, lines, "/v1/score")
    assert before["errors"] is None and before["basis"]["token_counts"] == "tokenizer"
    assert (before["max_output_tokens"], before["expected_output_tokens"]) == (0, 0)
    done = wait_terminal(client, client.batches.create(input_file_id=file_id, endpoint="/v1/score",
                                                       completion_window="24h").id)  # fmt: skip
    assert done.status == "completed" and done.request_counts.completed == 2
    pairs = len(DOCUMENTS) + 2
    # Each pair's texts are tokenized apart: at most a few special tokens a pair more than the model joining them.
    assert done.usage.input_tokens <= before["prompt_tokens"] <= done.usage.input_tokens + 2 * pairs
    _, after = _estimate(client, lines, "/v1/score")
    assert after["basis"]["rate"] == "measured" and after["basis"]["rate_unit"] == "input_tokens"
    assert after["eta_seconds"] is not None and after["eta_seconds"] > 0
