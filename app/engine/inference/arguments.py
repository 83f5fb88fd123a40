"""The top-level arguments a request may carry at each endpoint: what OpenAI refuses with "Unrecognized request
argument supplied", and vLLM's request models take and drop with a log line (`extra="allow"`).

Known are the fields of vLLM's own request model for the endpoint, and their aliases, as vLLM itself tells the ones
it ignores (`OpenAIBaseModel.__log_extra_fields__`), over every member of a union (an embedding request is
completion-style or chat-style); and OpenAI's own arguments for the endpoint, from the `openai` package vLLM depends
on (`store`, `metadata`, `prediction`, ...: OpenAI takes them, vLLM ignores them, and code written for OpenAI sends
them). Either set unreadable (a release that moved them): None, and nothing is refused, as before.
"""

from __future__ import annotations

import importlib
import logging
import typing
from typing import Any

log = logging.getLogger("vbatch.engine")

# OpenAI's request parameters for each endpoint it has, in the openai package (TypedDicts of every release since 1.x).
_OPENAI_PARAMETERS = {
    "/v1/chat/completions": ("openai.types.chat.completion_create_params", "CompletionCreateParamsBase"),
    "/v1/completions": ("openai.types.completion_create_params", "CompletionCreateParamsBase"),
    "/v1/embeddings": ("openai.types.embedding_create_params", "EmbeddingCreateParams"),
    "/v1/responses": ("openai.types.responses.response_create_params", "ResponseCreateParamsBase"),
}


def known_arguments(endpoint: str, request_type: Any) -> frozenset[str] | None:
    """Every top-level argument a body at `endpoint` may have, validated by `request_type` (a pydantic model or a
    union of them); None when either side cannot be read."""
    fields = model_arguments(request_type)
    openai = openai_arguments(endpoint)
    if fields is None or openai is None:
        log.warning("the arguments of %s cannot be read: unknown ones are not refused there", endpoint)
        return None
    return fields | openai


def model_arguments(request_type: Any) -> frozenset[str] | None:
    """The field names and aliases of a pydantic model, or of each member of a union (Annotated and Optional seen
    through); None for anything else."""
    fields = getattr(request_type, "model_fields", None)
    if isinstance(fields, dict):
        names = set(fields)
        names.update(field.alias for field in fields.values() if isinstance(getattr(field, "alias", None), str))
        return frozenset(names)
    members = [member for member in typing.get_args(request_type) if member is not type(None)]
    if typing.get_origin(request_type) is typing.Annotated:
        members = members[:1]
    found = [model_arguments(member) for member in members]
    if not found or any(names is None for names in found):
        return None
    return frozenset().union(*typing.cast(list[frozenset[str]], found))


def openai_arguments(endpoint: str) -> frozenset[str] | None:
    """OpenAI's arguments for `endpoint` (none for an endpoint OpenAI has not: vLLM's scoring ones); None when the
    openai package does not say."""
    where = _OPENAI_PARAMETERS.get(endpoint)
    if where is None:
        return frozenset()
    try:
        params = getattr(importlib.import_module(where[0]), where[1])
        return frozenset(params.__required_keys__ | params.__optional_keys__)
    except (ImportError, AttributeError):
        return None
