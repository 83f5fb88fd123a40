"""Refusals in OpenAI's words on the shared real server (CPU vLLM), as the official openai SDK raises them: the
issue's examples, live and streamed, an argument no one takes, and the same refusals as batch error lines; vLLM's own
extra arguments still taken. None of them is a 5xx or leaves a traceback in the server's log."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL
from tests.e2e.helpers import chat_line, lines_of, submit, wait_terminal

HI = [{"role": "user", "content": "Say yes."}]
# About 12,000 tokens with the chat template: past the shared server's --max-model-len 2048.
LONG = [{"role": "user", "content": " ".join(["word"] * 9000)}]

# (body, expected param, code): the examples, and two bodies vLLM's validators raised on (a 500 before).
REFUSED = {
    "temperature": ({"messages": HI, "temperature": 5}, "temperature", "invalid_value"),
    "long-prompt": ({"messages": LONG}, "messages", "context_length_exceeded"),
    "no-messages": ({}, "messages", "missing_required_parameter"),
    "empty-messages": ({"messages": []}, "messages", "empty_array"),
    "no-choices": ({"messages": HI, "n": 0}, "n", "invalid_value"),
    "unknown-argument": ({"messages": HI, "foo": 1}, "foo", "unknown_parameter"),
    "schema-missing": (
        {"messages": HI, "response_format": {"type": "json_schema"}},
        "response_format",
        "invalid_value",
    ),
}


@pytest.fixture
def quiet_log(server) -> Iterator[None]:
    """The server logs no traceback while the test runs."""
    start = server.log_path.stat().st_size
    yield
    with server.log_path.open("rb") as log:
        log.seek(start)
        assert b"Traceback" not in log.read()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", REFUSED)
def test_the_sdk_raises_openais_class_type_code_and_param(openai_client: OpenAI, quiet_log, case, stream):
    body, param, code = REFUSED[case]
    with pytest.raises(openai.BadRequestError) as refused:
        # `post` so that a body the SDK's types would not let through (no `messages`) is sent as it is.
        openai_client.post("/chat/completions", body={"model": MODEL, "max_tokens": 4, **body, "stream": stream},
                           cast_to=object)  # fmt: skip
    error = refused.value
    assert (error.status_code, error.type, error.param, error.code) == (400, "invalid_request_error", param, code)
    assert "priority" not in error.message and "input_value" not in error.message and "parameter=" not in error.message


def test_completions_and_responses_refusals_name_their_own_arguments(openai_client: OpenAI, quiet_log):
    with pytest.raises(openai.BadRequestError) as no_prompt:  # vLLM's validator raised here: a 500 before
        openai_client.post("/completions", body={"model": MODEL}, cast_to=object)
    assert (no_prompt.value.param, no_prompt.value.code) == ("prompt", "invalid_value")
    with pytest.raises(openai.BadRequestError) as too_long:
        openai_client.responses.create(model=MODEL, input=LONG[0]["content"])
    assert (too_long.value.param, too_long.value.code) == ("input", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as unknown:
        openai_client.responses.create(model=MODEL, input="Say yes.", extra_body={"foo": 1})
    assert (unknown.value.param, unknown.value.code) == ("foo", "unknown_parameter")


def test_vllms_own_arguments_and_openais_unimplemented_ones_are_still_taken(openai_client: OpenAI):
    vllm_extras = {"top_k": 5, "repetition_penalty": 1.1, "min_p": 0.05, "structured_outputs": {"choice": ["yes"]}}
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, store=False, metadata={"job": "e2e"}, extra_body=vllm_extras
    )
    assert answer.choices[0].message.content == "yes"  # the structured output was applied


def test_refused_batch_lines_carry_openais_error_in_the_response_body(openai_client: OpenAI):
    lines = [
        chat_line("hot", "Say yes.", temperature=5),
        chat_line("unknown", "Say yes.", foo=1),
        chat_line("long", LONG[0]["content"]),
        chat_line("ok", "Say yes.", top_k=5),
    ]
    done = wait_terminal(openai_client, submit(openai_client, lines).id)
    assert done.status == "completed" and done.request_counts.failed == 3, done
    assert [line["custom_id"] for line in lines_of(openai_client, done.output_file_id)] == ["ok"]
    errors = {line["custom_id"]: line for line in lines_of(openai_client, done.error_file_id)}
    for custom_id, param, code in (
        ("hot", "temperature", "invalid_value"),
        ("unknown", "foo", "unknown_parameter"),
        ("long", "messages", "context_length_exceeded"),
    ):
        line = errors[custom_id]
        assert line["error"] is None and line["response"]["status_code"] == 400  # OpenAI's layout for a 4xx
        error = line["response"]["body"]["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), line
