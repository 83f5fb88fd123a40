from __future__ import annotations

import io
import json
import time

from openai import OpenAI
from openai.types import Batch

from tests.e2e.conftest import MODEL

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def chat_line(custom_id: str, question: str, max_tokens: int = 8, **extra) -> dict:
    messages = [{"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def to_jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def submit(client: OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions", **extra) -> Batch:
    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(to_jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **extra)


def wait_until(client: OpenAI, batch_id: str, done, timeout: float = 600) -> Batch:
    """Polls as a user's app would, until done(batch) holds; fails after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not get there in {timeout} s (last: {batch.status})")


def wait_terminal(client: OpenAI, batch_id: str, timeout: float = 600) -> Batch:
    return wait_until(client, batch_id, lambda b: b.status in TERMINAL, timeout)


def lines_of(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
