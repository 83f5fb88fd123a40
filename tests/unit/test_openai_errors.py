"""Engine refusals in OpenAI's words (`app.domain.openai_errors`), from what vLLM 0.32's serving layer answered the
issue's examples with (taken from the real CPU engine); the arguments the serving layer takes
(`app.engine.inference.arguments`) read from vLLM's own request models; and `vbatch api` answering what its worker's
engine answered (fake engines). The same refusals over HTTP with the real engine and the openai SDK are in
tests/e2e/test_openai_errors.py.

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_openai_errors.py."""

from __future__ import annotations

import json

import pytest

from app.domain.openai_errors import (
    invalid_arguments,
    openai_error,
    openai_event,
    unknown_argument,
)

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def vllm(message: str, param: str | None = None, kind: str = "BadRequestError", code: int = 400) -> dict:
    return {"message": message, "type": kind, "param": param, "code": code}


@pytest.mark.parametrize(
    ("endpoint", "body", "answered", "expected"),
    [
        (  # temperature: 5
            CHAT,
            {"messages": HI, "temperature": 5},
            vllm("temperature must be in [0, 2], got 5.0. (parameter=temperature, value=5.0)", "temperature"),
            ("temperature must be in [0, 2], got 5.0.", "temperature", "invalid_value"),
        ),
        (  # a prompt over the context length: vLLM's internal `input_tokens` is no argument of the request
            CHAT,
            {"messages": HI},
            vllm(
                "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                "the input prompt. (parameter=input_tokens, value=2049)",
                "input_tokens",
            ),
            (
                "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                "the input prompt.",
                "messages",
                "context_length_exceeded",
            ),
        ),
        (  # the same on the Responses API, and an older release's wording with no parameter
            "/v1/responses",
            {"input": "hi"},
            vllm("This model's maximum context length is 2048 tokens. However, you requested 2100 tokens."),
            (
                "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens.",
                "input",
                "context_length_exceeded",
            ),
        ),
        (  # n: 0, named by vLLM only in its message
            CHAT,
            {"messages": HI, "n": 0},
            vllm("n must be at least 1, got 0."),
            ("n must be at least 1, got 0.", "n", "invalid_value"),
        ),
        (  # messages: []
            CHAT,
            {"messages": []},
            vllm("Cannot apply chat template to an empty conversation. Provide at least one message."),
            (
                "Cannot apply chat template to an empty conversation. Provide at least one message.",
                "messages",
                "empty_array",
            ),
        ),
        (  # vLLM's `max_tokens` is the argument the body spelled `max_completion_tokens`
            CHAT,
            {"messages": HI, "max_completion_tokens": -1},
            vllm("max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)", "max_tokens"),
            ("max_tokens must be at least 1, got -1.", "max_completion_tokens", "invalid_value"),
        ),
        (  # and `logprobs` the body's `top_logprobs`
            CHAT,
            {"messages": HI, "logprobs": True, "top_logprobs": 50},
            vllm(
                "Requested sample logprobs of 50, which is greater than max allowed: 20 (parameter=logprobs, value=50)",
                "logprobs",
            ),
            ("Requested sample logprobs of 50, which is greater than max allowed: 20", "top_logprobs", "invalid_value"),
        ),
        (  # a refusal that names no argument keeps none
            CHAT,
            {"messages": HI},
            vllm("The served model cannot answer /v1/embeddings; this engine answers /v1/chat/completions."),
            ("The served model cannot answer /v1/embeddings; this engine answers /v1/chat/completions.", None, None),
        ),
    ],
)
def test_each_refusal_of_vllms_gets_openais_type_code_and_param(endpoint, body, answered, expected):
    message, param, code = expected
    assert openai_error(400, answered, endpoint=endpoint, body=body) == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": code,
    }


def test_a_server_error_is_openais_server_error_and_a_model_not_served_its_404():
    failed = openai_error(500, vllm("the handler failed", kind="InternalServerError", code=500))
    assert failed == {"message": "the handler failed", "type": "server_error", "param": None, "code": None}
    gone = openai_error(503, vllm("", kind="ServiceUnavailableError", code=503))
    assert gone["type"] == "server_error" and gone["message"]
    missing = openai_error(404, vllm("The model `nope` does not exist.", "model", "NotFoundError", 404))
    assert (missing["type"], missing["param"], missing["code"]) == ("invalid_request_error", "model", "model_not_found")


def test_an_error_already_in_openais_words_passes_unchanged():
    ours = {"message": "Unrecognized request argument supplied: 'foo'.", "type": "invalid_request_error",
            "param": "foo", "code": "unknown_parameter"}  # fmt: skip
    assert openai_error(400, ours, endpoint=CHAT, body={"foo": 1}) == ours
    assert openai_error(400, openai_error(400, vllm("n must be at least 1, got 0."), body={"n": 0}), body={"n": 0}) == {
        "message": "n must be at least 1, got 0.",
        "type": "invalid_request_error",
        "param": "n",
        "code": "invalid_value",
    }


def test_pydantics_errors_name_the_argument_never_the_body_they_quote():
    # What ChatCompletionRequest raised for a body with no `messages` (vbatch had added `priority`).
    missing = [{"type": "missing", "loc": ("messages",), "msg": "Field required", "input": {"priority": 0}}]
    assert invalid_arguments(missing) == {
        "message": "Missing required parameter: 'messages'.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "missing_required_parameter",
    }
    wrong = [
        {
            "type": "float_parsing",
            "loc": ("messages", 0, "ChatCompletionUserMessageParam", "content"),
            "msg": "Input should be a valid number, unable to parse string as a number",
            "input": "hot",
        }
    ]
    refused = invalid_arguments(wrong)
    assert (refused["param"], refused["code"]) == ("messages[0].content", "invalid_value")
    assert "hot" not in refused["message"] and "priority" not in json.dumps(refused)


def test_an_argument_no_one_takes_is_refused_as_openai_refuses_it():
    known = frozenset({"model", "messages", "top_k"})
    assert unknown_argument({"model": "m", "messages": HI, "top_k": 2}, known) is None
    assert unknown_argument({"model": "m", "foo": 1, "bar": 2}, known) == {
        "message": "Unrecognized request argument supplied: 'foo'.",
        "type": "invalid_request_error",
        "param": "foo",
        "code": "unknown_parameter",
    }
    assert unknown_argument({"foo": 1}, None) is None  # the arguments could not be read: nothing refused
    long = unknown_argument({"x" * 5000: 1}, known)
    assert long is not None and len(long["param"]) < 300


def test_a_streams_error_event_gets_openais_error_object_and_other_events_pass():
    chunk = 'data: {"id":"chatcmpl-1","choices":[]}\n\n'
    assert openai_event(chunk) == chunk
    failed = 'data: {"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
    assert json.loads(openai_event(failed).removeprefix("data: ")) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }
