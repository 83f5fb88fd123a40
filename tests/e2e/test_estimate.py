"""`POST /v1/batches/estimate` on the real CPU engine, through the official openai SDK (issue 31): the seed's tickets
file (`app.testing.write_ticket_batch`, as `bench.compare` runs it on the CPU, shorter) is estimated, run, estimated
again and run again. Prompt tokens are the engine's own count (the chat template applied), so they equal the batch's
usage exactly; once one batch of the same shape has run, the expected output and the ETA are within 30% of the next
batch's actual."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

from openai import OpenAI

from app.domain import estimates
from app.testing import TICKET_SAMPLING, write_ticket_batch
from tests.e2e.conftest import MODEL
from tests.e2e.helpers import lines_of, wait_terminal

# The bench's sampling with a seed: two runs of one file then answer alike, so the 30% below is the estimate's own
# error, not the sampler's. Unseeded, two runs of the 60 lines at 64 gave 2,019 and 1,523 output tokens (CI of
# 0361acb), and of 32 lines 1,064 and 877 (CI of d8bfcdc).
SAMPLING = {**TICKET_SAMPLING, "seed": 40}
# Three waves of the server's 8 lines in flight, as `bench.compare`'s CPU run (--prompts 48 --max-tokens 32) has six:
# the estimate's figures are of whole waves, and each token here costs the session's other worker its CPU.
TICKETS = 24
MAX_TOKENS = 32
CHAT = "/v1/chat/completions"
# Issue 38: batches of a wave of tickets at max_tokens 16, then a file at 64. As many small batches as the estimate
# keeps (`estimates.HISTORY_BATCHES`), so that no other test's batch of this session is in its history.
SHORT_BATCHES, SHORT_LINES, SHORT_CAP = 5, 8, 16
LONG_LINES, LONG_CAP = 60, 64


def _estimate(client: OpenAI, file_id: str) -> dict:
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    return client.post("/batches/estimate", body=body, cast_to=object)  # type: ignore[return-value]


def _upload_tickets(client: OpenAI, path: Path, count: int, max_tokens: int, first: int) -> str:
    write_ticket_batch(path, count, model=MODEL, sampling={**SAMPLING, "max_tokens": max_tokens}, first=first)
    return client.files.create(file=(path.name, io.BytesIO(path.read_bytes())), purpose="batch").id


def _run(client: OpenAI, server, file_id: str) -> tuple[list[dict], dict, float]:
    """The batch's result lines, its usage and its run's seconds (the progress timeline's last result)."""
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    done = wait_terminal(client, batch.id)
    assert done.status == "completed", done
    progress = client.get(f"/batches/{batch.id}/progress", cast_to=object)
    return lines_of(client, done.output_file_id), done.usage.model_dump(), progress["timeline"]["last_result"]


def test_the_tickets_estimate_matches_what_the_batch_did(openai_client, server, tmp_path: Path):
    path = tmp_path / "tickets.jsonl"
    write_ticket_batch(path, TICKETS, model=MODEL, sampling={**SAMPLING, "max_tokens": MAX_TOKENS})
    uploaded = openai_client.files.create(file=("tickets.jsonl", io.BytesIO(path.read_bytes())), purpose="batch")

    before = _estimate(openai_client, uploaded.id)
    assert before["object"] == "batch.estimate" and before["errors"] is None
    assert before["lines"] == TICKETS and before["basis"]["token_counts"] == "tokenizer"
    assert before["max_output_tokens"] == TICKETS * MAX_TOKENS

    first, first_usage, _ = _run(openai_client, server, uploaded.id)
    prompt_tokens = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in first)
    assert before["prompt_tokens"] == prompt_tokens == first_usage["input_tokens"]

    after = _estimate(openai_client, uploaded.id)
    assert after["basis"]["rate"] == "measured" and after["basis"]["history_batch_ids"][0]
    second, second_usage, second_seconds = _run(openai_client, server, uploaded.id)
    figures = {
        "prompt_tokens": [after["prompt_tokens"], second_usage["input_tokens"]],
        "output_tokens": [after["expected_output_tokens"], second_usage["output_tokens"]],
        "eta_seconds": [after["eta_seconds"], second_seconds],
        "cached_tokens": [after["expected_cached_tokens"], second_usage["input_tokens_details"]["cached_tokens"]],
    }
    print("estimate vs actual (CPU, tickets):", json.dumps(figures))
    assert after["prompt_tokens"] == second_usage["input_tokens"]
    assert abs(after["expected_output_tokens"] - second_usage["output_tokens"]) <= 0.3 * second_usage["output_tokens"]
    assert abs(after["eta_seconds"] - second_seconds) <= 0.3 * second_seconds
    assert len(second) == TICKETS


def test_a_shared_instruction_is_expected_cached_as_the_engine_caches_it(openai_client, tmp_path: Path):
    """Lines that begin with the same long instruction: after the first, the engine's prefix cache gives each the
    whole blocks of it (128 tokens a block on the CPU), and the estimate expects the same. A nonce of this run first,
    so that no earlier test's prompts have left it cached."""
    instruction = f"Run {uuid.uuid4().hex}. " + "Label the support ticket below by its topic, one word. " * 30
    lines = [
        {"custom_id": f"t{i}", "method": "POST", "url": CHAT, "body": {
            "model": MODEL, "max_tokens": 1, "messages": [
                {"role": "system", "content": instruction}, {"role": "user", "content": f"Ticket {i}: login fails."}]}}
        for i in range(12)
    ]  # fmt: skip
    path = tmp_path / "instructed.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    uploaded = openai_client.files.create(file=("instructed.jsonl", path.read_bytes()), purpose="batch")
    expected = _estimate(openai_client, uploaded.id)
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = wait_terminal(openai_client, batch.id)
    actual = done.usage.model_dump()["input_tokens_details"]["cached_tokens"]
    print("cached tokens, estimate vs actual (CPU):", expected["expected_cached_tokens"], actual)
    assert expected["prompt_tokens"] == done.usage.input_tokens
    assert expected["expected_cached_tokens"] > 0 and expected["expected_cached_share"] > 0.5
    assert abs(expected["expected_cached_tokens"] - actual) <= 0.1 * expected["expected_cached_tokens"]


def test_after_batches_cut_at_a_lower_cap_the_actual_is_inside_the_range(openai_client, server, tmp_path: Path):
    """The issue's case: answers cut at max_tokens 16 say only that they would have run at least 16 tokens, so a
    file at 64 gets a range its actual falls in (it got one figure, a quarter of the actual). Once one batch at 64
    has run, it alone is the history, and the expected output and ETA are within 30% of the next batch's."""
    assert SHORT_BATCHES == estimates.HISTORY_BATCHES
    for k in range(SHORT_BATCHES):
        short = _upload_tickets(openai_client, tmp_path / f"short-{k}.jsonl", SHORT_LINES, SHORT_CAP, k * SHORT_LINES)
        _run(openai_client, server, short)
    long_id = _upload_tickets(openai_client, tmp_path / "long.jsonl", LONG_LINES, LONG_CAP, 1000)
    before = _estimate(openai_client, long_id)
    basis = before["basis"]
    assert basis["output"] == "range" and basis["history_cut_lines"] > 0, basis
    assert basis["history_lines"] == SHORT_BATCHES * SHORT_LINES
    _, first_usage, first_seconds = _run(openai_client, server, long_id)
    low, high = before["expected_output_tokens_low"], before["expected_output_tokens_high"]
    print(
        "cut at 16, then a file at 64 (CPU):",
        json.dumps(
            {
                "output": [low, before["expected_output_tokens"], high, first_usage["output_tokens"]],
                "eta_seconds": [
                    before["eta_seconds_low"],
                    before["eta_seconds"],
                    before["eta_seconds_high"],
                    first_seconds,
                ],
                "output_reason": basis["output_reason"],
            }
        ),
    )
    assert low <= first_usage["output_tokens"] <= high

    after = _estimate(openai_client, long_id)
    assert after["basis"]["output"] == "measured" and len(after["basis"]["history_batch_ids"]) == 1
    _, second_usage, second_seconds = _run(openai_client, server, long_id)
    actual = second_usage["output_tokens"]
    print(
        "after one batch at 64 (CPU):",
        json.dumps(
            {"output": [after["expected_output_tokens"], actual], "eta_seconds": [after["eta_seconds"], second_seconds]}
        ),
    )
    assert abs(after["expected_output_tokens"] - actual) <= 0.3 * actual
    assert abs(after["eta_seconds"] - second_seconds) <= 0.3 * second_seconds
