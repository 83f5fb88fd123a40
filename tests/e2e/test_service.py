"""The real service, the real CPU engine, the official SDK: what a user sees."""

from __future__ import annotations

from collections import Counter

from tests.e2e.conftest import MODEL, TEST_WINDOW
from tests.e2e.helpers import chat_line, lines_of, submit, to_jsonl, wait_terminal, wait_until
from tests.helpers import holding
from tests.schemas import validate

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello."]


def test_chat_batch_completes_with_real_answers(openai_client):
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    lines.append(chat_line("rejected", "Hi", max_tokens=-1))
    batch = submit(openai_client, lines, metadata={"suite": "e2e"})
    assert batch.status == "validating"

    done = wait_terminal(openai_client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 5
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
    assert done.model == MODEL and done.metadata == {"suite": "e2e"}
    validate(done.model_dump(), "Batch")

    outputs = lines_of(openai_client, done.output_file_id)
    errors = lines_of(openai_client, done.error_file_id)
    ids = Counter(line["custom_id"] for line in outputs + errors)
    assert ids == Counter({f"q{i}": 1 for i in range(4)} | {"rejected": 1})
    for line in outputs:
        validate(line, "BatchRequestOutput", document=1)
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["content"].strip()
        assert 0 < body["usage"]["completion_tokens"] <= 8
    [rejected] = errors
    assert rejected["response"]["status_code"] == 400 and rejected["error"] is None
    assert rejected["response"]["body"]["error"]["message"]

    usage = done.usage
    assert usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)
    assert usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    output_file = openai_client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    validate(output_file.model_dump(), "OpenAIFile")


def test_completions_batch(openai_client):
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"The number after {i} is", "max_tokens": 4}}
        for i in range(3)
    ]  # fmt: skip
    done = wait_terminal(openai_client, submit(openai_client, lines, endpoint="/v1/completions").id)
    assert done.status == "completed" and done.request_counts.completed == 3
    outputs = lines_of(openai_client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == ["c0", "c1", "c2"]
    assert all(o["response"]["body"]["object"] == "text_completion" for o in outputs)
    assert all(o["response"]["body"]["choices"][0]["text"] for o in outputs)


def test_responses_batch(openai_client):
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
         "body": {"model": MODEL, "input": f"Name the colour number {i}.", "max_output_tokens": 6}}
        for i in range(2)
    ]  # fmt: skip
    done = wait_terminal(openai_client, submit(openai_client, lines, endpoint="/v1/responses").id)
    errors = lines_of(openai_client, done.error_file_id)
    assert done.status == "completed" and done.request_counts.completed == 2, errors
    outputs = lines_of(openai_client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == ["r0", "r1"]
    bodies = [o["response"]["body"] for o in outputs]
    assert all(b["object"] == "response" and b["status"] in ("completed", "incomplete") for b in bodies)
    assert done.usage.output_tokens == sum(b["usage"]["output_tokens"] for b in bodies) > 0
    assert done.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in bodies) > 0


def test_invalid_file_fails_with_line_numbers(openai_client):
    lines = [chat_line("a", "hi"), chat_line("a", "again"), chat_line("b", "hi") | {"url": "/v1/embeddings"}]
    lines.append(chat_line("c", "hi") | {"body": {"model": "gpt-4o", "messages": []}})
    done = wait_terminal(openai_client, submit(openai_client, lines).id)
    assert done.status == "failed" and done.failed_at is not None
    assert [(e.code, e.line) for e in done.errors.data] == [
        ("duplicate_custom_id", 2),
        ("mismatched_url", 3),
        ("model_not_found", 4),
    ]
    assert done.output_file_id is None and done.error_file_id is None


def test_cancel_while_running_keeps_finished_results(openai_client, server):
    lines = [chat_line(f"t{i}", f"Write a short story about the number {i}.", max_tokens=24) for i in range(30)]
    with holding(server.data_dir):  # at most 4 lines run: the cancel is certain to land mid-run
        batch = submit(openai_client, lines)
        wait_until(openai_client, batch.id, lambda b: b.request_counts.completed >= 1)
        cancelling = openai_client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        done = wait_terminal(openai_client, batch.id, timeout=120)

    assert done.status == "cancelled" and done.cancelled_at is not None
    outputs = lines_of(openai_client, done.output_file_id)
    errors = lines_of(openai_client, done.error_file_id)
    assert 1 <= len(outputs) <= 4 and len(errors) >= 1  # no more than the hold let through
    assert Counter(line["custom_id"] for line in outputs + errors) == Counter(f"t{i}" for i in range(30))
    assert all(o["response"]["body"]["object"] == "chat.completion" for o in outputs)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(outputs), len(errors))


def test_expiry_keeps_finished_results(openai_client, server):
    count = 12
    lines = [chat_line(f"e{i}", f"Describe the colour number {i}.") for i in range(count)]
    with holding(server.data_dir):  # 4 lines run, the rest wait: the window is certain to close mid-run
        uploaded = openai_client.files.create(file=("expire.jsonl", to_jsonl(lines)), purpose="batch")
        batch = openai_client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=TEST_WINDOW
        )
        done = wait_terminal(openai_client, batch.id)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    outputs = lines_of(openai_client, done.output_file_id)
    errors = lines_of(openai_client, done.error_file_id)
    assert 1 <= len(outputs) <= 4 and len(errors) >= 1  # no more than the hold let through
    assert Counter(line["custom_id"] for line in outputs + errors) == Counter(f"e{i}" for i in range(count))
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert all(e["response"] is None for e in errors)


def test_models_and_pagination(openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    every_batch = list(openai_client.batches.list(limit=2))
    assert len(every_batch) == len({b.id for b in every_batch}) >= 4
    every_file = list(openai_client.files.list(limit=2))
    assert len(every_file) == len({f.id for f in every_file})
