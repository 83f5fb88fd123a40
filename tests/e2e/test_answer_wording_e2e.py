"""Online answers of the real engine in OpenAI's words where vLLM's differ (issue 38): the tier served echoed, a null
`usage` on every chunk before the one that carries it, and no usage for a stream that did not ask for it (vbatch
asks the engine for it all the same, to charge what the stream generated)."""

from __future__ import annotations

from tests.e2e.conftest import MODEL

HELLO = [{"role": "user", "content": "Say hello."}]


def test_the_tier_served_is_echoed(openai_client):
    default = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    flex = openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, service_tier="flex")
    asked_auto = openai_client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=16,
                                                service_tier="auto")  # fmt: skip
    assert (default.service_tier, flex.service_tier, asked_auto.service_tier) == ("default", "flex", "default")


def test_a_stream_has_usage_only_where_its_client_asked(openai_client):
    asked = list(
        openai_client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    *chunks, last = asked
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert all("usage" in chunk.model_fields_set for chunk in chunks)  # present, and null, as OpenAI sends it
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens >= 1
    not_asked = list(openai_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stream=True))
    assert not_asked and all(chunk.choices and "usage" not in chunk.model_fields_set for chunk in not_asked)
    assert all(chunk.service_tier == "default" for chunk in [*asked, *not_asked])
