"""OpenAI's error objects for what the engine refuses, whoever asked: an online request, a batch line, a stream.

vLLM's serving layer answers a refusal with its own values in OpenAI's keys: `{"error": {"message", "type":
"BadRequestError", "param", "code": 400}}`, an exception's class as `type` and the HTTP status as `code`. Code
written against OpenAI reads `type` ("invalid_request_error" for a 4xx, "server_error" for a 5xx) and a string
`code` ("context_length_exceeded", "missing_required_parameter", "invalid_value", ...) with `param` naming the
request's argument, as the SDKs carry them (`BadRequestError.code`). `openai_error` maps the one onto the other;
vLLM's message is kept (it says what was wrong), less the `(parameter=..., value=...)` vLLM appends to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# The argument that holds each endpoint's prompt: what OpenAI names for a prompt over the model's context length.
PROMPT_ARGUMENT = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
    "/v1/responses": "input",
}
# What vLLM names a prompt over the model's context length by: its tokens, or its text before tokenizing (0.32);
# releases that name neither say so in the message.
_CONTEXT_PARAMETERS = ("input_tokens", "input_text")
_CONTEXT_WORDS = "maximum context length"
# vLLM's names for some sampling limits, and the arguments a body may have given them by (the first found is named).
_SPELLINGS = {
    "max_tokens": ("max_completion_tokens", "max_output_tokens", "max_tokens"),
    "logprobs": ("top_logprobs", "logprobs"),
}
# Longer argument names are cut in a message and in `param`: a body's keys may be anything.
_NAME_CHARS = 256
UNEXPECTED_MESSAGE = "The server had an error while processing your request."


def error_object(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict:
    return {"message": message, "type": type, "param": param, "code": code}


def openai_error(status: int, error: object, *, endpoint: str | None = None, body: object = None) -> dict:
    """`error` (the `error` of vLLM's envelope, answered with HTTP `status` to `body` at `endpoint`) as OpenAI's error
    object. One already OpenAI's (its `code` a string or null, not a status number) comes back as it is."""
    found = error if isinstance(error, Mapping) else {}
    code = found.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        return {key: found.get(key) for key in ("message", "type", "param", "code")}
    message = _without_vllm_suffix(str(found.get("message") or ""))
    if status >= 500:
        return error_object(message or UNEXPECTED_MESSAGE, type=SERVER_ERROR)
    arguments = body if isinstance(body, Mapping) else {}
    named = found.get("param") if isinstance(found.get("param"), str) else None
    if named in _CONTEXT_PARAMETERS or _CONTEXT_WORDS in message.lower():
        return error_object(message, param=PROMPT_ARGUMENT.get(endpoint or ""), code="context_length_exceeded")
    if status == 404 and named == "model":
        return error_object(message, param="model", code="model_not_found")
    param = _as_sent(named, arguments) if named else _named_first(message, arguments)
    if param is not None:
        return error_object(message, param=param, code="invalid_value")
    emptied = _the_empty_list(message, arguments)
    if emptied is not None:
        return error_object(message, param=emptied, code="empty_array")
    return error_object(message)


def invalid_arguments(errors: Sequence[Mapping]) -> dict:
    """OpenAI's error object for the first of pydantic's errors (`ValidationError.errors()`) that a request model
    raised on a body: the argument it names, never the body it quotes (which holds what vbatch added, `priority`)."""
    first = errors[0] if errors else {}
    param = _param_path(tuple(first.get("loc") or ()))
    kind = first.get("type")
    if kind == "missing" and param is not None:
        return missing_parameter(param)
    if kind == "extra_forbidden" and param is not None:
        return unrecognized_argument(param)
    reason = str(first.get("msg") or "Invalid value").removeprefix("Value error, ").rstrip(".")
    if param is None:
        return error_object(f"{reason}.")
    return error_object(f"Invalid value for '{param}': {reason}.", param=param, code="invalid_value")


def missing_parameter(name: str) -> dict:
    return error_object(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")


def unrecognized_argument(name: str) -> dict:
    """OpenAI's answer to an argument it does not take (its words, "Unrecognized request argument supplied")."""
    shown = _cut(name)
    return error_object(f"Unrecognized request argument supplied: '{shown}'.", param=shown, code="unknown_parameter")


def unknown_argument(body: Mapping, known: frozenset[str] | None) -> dict | None:
    """OpenAI's refusal of the first top-level argument of `body` outside `known`; None when all are known, or when
    what is known cannot be told (`known` None)."""
    if known is None:
        return None
    unknown = next((name for name in body if name not in known), None)
    return None if unknown is None else unrecognized_argument(str(unknown))


def openai_event(event: str, *, endpoint: str | None = None, body: object = None) -> str:
    """A server-sent event of a stream: vLLM's error event (`data: {"error": {...}}`) with OpenAI's error object,
    any other as it is."""
    if not event.startswith('data: {"error"'):
        return event
    try:
        sent = json.loads(event.removeprefix("data: "))
    except ValueError:
        return event
    error = sent.get("error") if isinstance(sent, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) else 500
    return error_data(openai_error(status, error, endpoint=endpoint, body=body))


def error_data(error: dict) -> str:
    """The event that carries an error object, as vLLM and OpenAI end a stream that failed (the SDKs raise it)."""
    return f"data: {json.dumps({'error': error})}\n\n"


def _without_vllm_suffix(message: str) -> str:
    """vLLM's validation errors end their text with `(parameter=..., value=...)`, which `param` says better."""
    for opening in (" (parameter=", " (value="):
        at = message.rfind(opening)
        if at != -1 and message.endswith(")"):
            return message[:at]
    return message


def _as_sent(named: str, arguments: Mapping) -> str:
    """vLLM's name for an argument as the body spelled it (`max_tokens` sent as `max_completion_tokens`, say)."""
    return next((name for name in _SPELLINGS.get(named, ()) if name in arguments), named)


def _named_first(message: str, arguments: Mapping) -> str | None:
    """The argument a message of vLLM's that names none in `param` begins with ("n must be at least 1")."""
    first = message.split(" ", 1)[0]
    return first if first and first in arguments else None


def _the_empty_list(message: str, arguments: Mapping) -> str | None:
    """The argument an "empty" refusal is about, when one argument alone is an empty list (`messages: []`)."""
    if "empty" not in message.lower():
        return None
    empty = [name for name, value in arguments.items() if value == [] and isinstance(name, str)]
    return empty[0] if len(empty) == 1 else None


def _param_path(loc: tuple) -> str | None:
    """pydantic's location of an error as OpenAI writes a parameter: `messages[0].content`. The names pydantic adds
    for a union's members ("ChatCompletionUserMessageParam", "function-after[...]") are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif path and (part[:1].isupper() or "[" in part or "(" in part):
            continue
        else:
            path += f".{part}" if path else str(part)
    return _cut(path) if path else None


def _cut(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS] + "..."
