"""Online requests on the shared real server while one of its batches runs: the official SDK streamed and not, curl
with -N, and LiteLLM pointed at vbatch; the batch then completes with every custom_id once."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.e2e.conftest import KEYS, MODEL
from tests.e2e.helpers import chat_line, lines_of, submit, wait_terminal, wait_until
from tests.helpers import holding

HI = [{"role": "user", "content": "Say hello in one short sentence."}]


@pytest.fixture(scope="module")
def running_batch(server, openai_client: OpenAI) -> Iterator[str]:
    """A batch in progress for the module's tests: its first lines long, the rest held back until the module ends;
    then it must complete with every line once."""
    lines = [chat_line(f"long{i}", "Count slowly from one to fifty.", max_tokens=160) for i in range(4)]
    lines += [chat_line(f"short{i}", "Say yes.") for i in range(6)]
    with holding(server.data_dir):
        batch = submit(openai_client, lines)
        wait_until(openai_client, batch.id, lambda b: b.status == "in_progress")
        yield batch.id
    done = wait_terminal(openai_client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(lines), done
    answered = Counter(line["custom_id"] for line in lines_of(openai_client, done.output_file_id))
    assert answered == Counter(line["custom_id"] for line in lines)


def still_running(client: OpenAI, batch_id: str) -> None:
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "in_progress" and batch.request_counts.completed < batch.request_counts.total


def test_the_sdk_streams_an_answer_while_a_batch_runs(openai_client, running_batch):
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 24
    assert {c.model for c in chunks} == {MODEL}
    still_running(openai_client, running_batch)


def test_the_sdk_gets_a_whole_answer_and_a_flex_one(openai_client, running_batch):
    answer = openai_client.chat.completions.create(model=MODEL, messages=HI, max_tokens=16)
    assert answer.object == "chat.completion" and answer.choices[0].message.content.strip()
    flex = openai_client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, service_tier="flex")
    assert flex.object == "chat.completion" and flex.usage.completion_tokens > 0
    completion = openai_client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4)
    assert completion.object == "text_completion" and completion.usage.completion_tokens > 0
    still_running(openai_client, running_batch)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not on this machine")
def test_curl_with_no_buffer_gets_the_events_as_vllm_sends_them(server, running_batch):
    body = {"model": MODEL, "messages": HI, "max_tokens": 12, "stream": True}
    shown = subprocess.run(
        ["curl", "-sS", "-N", f"{server.base_url}/v1/chat/completions", "-H", f"Authorization: Bearer {KEYS[0]}",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    events = [line for line in shown.stdout.splitlines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip()


def test_litellm_pointed_at_vbatch_gets_answers(server, running_batch, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its own price list, not one fetched at import
    import litellm

    settings = {"model": f"openai/{MODEL}", "api_base": f"{server.base_url}/v1", "api_key": KEYS[0]}
    answer = litellm.completion(messages=HI, max_tokens=12, **settings)
    assert answer.choices[0].message.content.strip()
    streamed = litellm.completion(messages=HI, max_tokens=12, stream=True, **settings)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed).strip()


def test_an_unknown_model_is_404_model_not_found(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as refused:
        openai_client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=4)
    assert refused.value.code == "model_not_found"
