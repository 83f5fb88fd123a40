"""The online endpoints, `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/responses`:
answered at once by the engine (`EngineView.respond`), as JSON or as server-sent events, exactly as `vllm serve`
answers them.

HTTP only: the body read and parsed, its model checked against those served, the key's limits charged, the call
made, the answer written back with OpenAI's `x-ratelimit-*` headers. A client that goes away ends its request in
the engine: the call is cancelled while no answer has come, a stream's events are closed once it has. As answers
pass, their timings go to the `vbatch_live_*` series.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api.bodies import ClientGone, json_object
from app.api.deps import OwnerDep
from app.api.errors import APIError, from_domain, respond
from app.api.streams import EventStream, MeasuredEvents, unless_client_leaves
from app.core.errors import DomainError
from app.core.lora_dir import LoraDir, lora_dir
from app.domain.adapters import RecentMisses
from app.domain.answers import AnswerWording
from app.domain.cost import weighed_tokens
from app.domain.errors import ModelNotServed
from app.domain.online import ONLINE_ENDPOINTS, OnlineAnswer, OnlineRequest, check_choices, online_priority
from app.domain.ratelimits import (
    Admission,
    Quota,
    RateLimited,
    RateLimiter,
    duration,
    estimated_tokens,
    output_tokens,
    used_tokens,
)
from app.engine.online.view import EngineView
from app.engine.telemetry.metrics import LIVE, EngineTime, OnlineMetrics, Payer, key_label

router = APIRouter(tags=["online"])

# The label of a request whose body names no model served here (refused, or left to the engine to refuse).
UNKNOWN_MODEL = "unknown"
# The access log's status for a request whose client left before its answer (nginx's word for it).
CLIENT_GONE = 499
_OPERATIONS = {
    "/v1/chat/completions": ("create_chat_completion", "A chat completion, as vLLM's /v1/chat/completions."),
    "/v1/completions": ("create_completion", "A completion, as vLLM's /v1/completions."),
    "/v1/embeddings": ("create_embedding", "Embeddings, as vLLM's /v1/embeddings (an engine that embeds)."),
    "/v1/responses": ("create_response", "A response, as vLLM's /v1/responses."),
}


class OnlineCall:
    """One online request, from its body to its answer's last byte."""

    def __init__(self, request: Request, endpoint: str, owner: str) -> None:
        state = request.app.state
        self.request = request
        self.endpoint = endpoint
        self.owner = owner
        self.engine: EngineView = state.engine
        self.limiter: RateLimiter = state.online_limits
        self.metrics: OnlineMetrics = state.metrics.online
        # This process's engine's time (None where no engine runs: a `vbatch api` replica; its worker charges it).
        self.engine_time: EngineTime | None = state.metrics.engine_time
        self.most_bytes: int = state.settings.max_json_body_bytes
        self.most_choices: int = state.settings.max_choices_per_request
        self.found_adapters = lora_dir(state.settings)
        self.unknown_models: RecentMisses = state.unknown_models
        self.wording = AnswerWording(endpoint, None, usage_asked=False)
        self.key = key_label(owner)
        self.model = UNKNOWN_MODEL
        self.started = time.perf_counter()
        self.admission: Admission | None = None

    async def answer(self) -> Response:
        try:
            raw, body = await json_object(self.request, self.most_bytes)
            self.wording = AnswerWording.of(self.endpoint, body)
            online_priority(body)  # an unknown service_tier is refused before anything is charged
            check_choices(body, self.most_choices)
            # Charged before the model is looked up: a name that is no model costs the key as any request does.
            self.admission = self.limiter.admit(
                self.owner, tokens=estimated_tokens(self.endpoint, body), model=_named_model(body)
            )
            self.model = await self._served_model(body)
            sent = time.perf_counter()
            online = OnlineRequest(self.endpoint, body, raw, self.owner)
            answer = await unless_client_leaves(self.engine.respond(online), self.request)
            if answer is None and self.engine_time is not None:  # its engine request aborted: it pays by its time
                self.engine_time.timed(self.payer, time.perf_counter() - sent, answered=False)
        except (APIError, DomainError) as exc:
            return self._refused(exc)
        except ClientGone:
            answer = None
        if answer is None:  # what it was charged stands: the engine may have worked on it until the client left
            self.metrics.answered(key=self.key, model=self.model, endpoint=self.endpoint, status=CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        self.metrics.answered(key=self.key, model=self.model, endpoint=self.endpoint, status=answer.status)
        if answer.events is not None:
            quota = self.admission.quota if self.admission is not None else Quota()
            events = MeasuredEvents(answer.events, self, self.wording)
            return EventStream(events, status_code=answer.status, headers=limit_headers(quota))
        return self._json(answer)

    async def _served_model(self, body: dict) -> str:
        """The model the request names, refused unless it is served (none named: the engine's first). While no
        engine serves yet, the engine's own answer says so. A name found to be no model is remembered a while."""
        model = body.get("model")
        lookup = self.found_adapters if isinstance(model, str) and model not in self.unknown_models else None
        # An API replica reads the served models from the workers' beats in the database: off the loop.
        served = await asyncio.to_thread(_served_models, self.engine, model, lookup)
        if model is None or model == "":
            return served[0] if served else UNKNOWN_MODEL
        if not isinstance(model, str) or not served:
            return UNKNOWN_MODEL  # the engine's own answer refuses it, or says that no engine serves yet
        if model not in served:
            self.unknown_models.add(model)
            raise ModelNotServed(model)
        return model

    def _json(self, answer: OnlineAnswer) -> Response:
        usage = answer.body.get("usage") if isinstance(answer.body, dict) else None
        used = used_tokens(usage)
        # An error answer carries no usage: nothing was generated, so nothing is charged but the request itself.
        quota = self.settle(0 if used is None and answer.status >= 400 else used)
        self.ended(output_tokens(usage) or 0, usage)
        body = self.wording.body(answer.body) if isinstance(answer.body, dict) else answer.body
        return EngineJSON(body, status_code=answer.status, headers=limit_headers(quota))

    def _refused(self, exc: APIError | DomainError) -> Response:
        error = exc if isinstance(exc, APIError) else from_domain(exc)
        quota = exc.quota if isinstance(exc, RateLimited) else self.settle(0)
        self.metrics.answered(key=self.key, model=self.model, endpoint=self.endpoint, status=error.status_code)
        response = respond(error)
        response.headers.update(limit_headers(quota))
        return response

    def settle(self, used: int | None) -> Quota:
        """The key's allowance now, this request's charge corrected to `used` tokens when known."""
        if self.admission is None or used is None:
            return self.limiter.quota(self.owner)
        return self.limiter.settle(self.admission, tokens_used=used)

    def ended(self, output: int, usage: object) -> None:
        """The answer's last byte is sent (or its client gone): `output` tokens, and its `usage` if it told one. The
        engine time it used is charged by the usage's tokens; a stream that told none, by its output events."""
        seconds = time.perf_counter() - self.started
        self.metrics.ended(key=self.key, model=self.model, seconds=seconds, output_tokens=output)
        if self.engine_time is not None:
            tokens = weighed_tokens(usage) if isinstance(usage, dict) else output
            self.engine_time.used(self.payer, tokens)
            self.engine_time.timed(self.payer, seconds, answered=True)

    @property
    def payer(self) -> Payer:
        return Payer(LIVE, self.key, self.model)


def _named_model(body: dict) -> str:
    """The model a body names, as a rate limit's message shows it (before it is known to be one)."""
    model = body.get("model")
    return model[:256] if isinstance(model, str) and model else UNKNOWN_MODEL


def _served_models(engine: EngineView, model: object, found_adapters: LoraDir | None) -> list[str]:
    """The served models, and `model` too when it is an adapter of `VBATCH_LORA_DIR`: the engine loads it at this
    first use, and answers whatever keeps it from serving (another base model, too high a rank)."""
    served = engine.served_models
    if found_adapters is None or not isinstance(model, str) or not model or model in served:
        return served
    return [*served, model] if found_adapters.has(model) else served


class EngineJSON(JSONResponse):
    """The engine's JSON answer; one that echoes a lone surrogate or a NaN from its request still goes out, escaped,
    where Starlette's rendering would fail (a 500 for what was bad input)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # UnicodeEncodeError is one
            return json.dumps(content, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode()


def limit_headers(quota: Quota) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers, for each limit the key has."""
    headers = {}
    for kind, allowance in (("requests", quota.requests), ("tokens", quota.tokens)):
        if allowance is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(allowance.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(allowance.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration(allowance.reset_seconds)
    return headers


def _route(endpoint: str) -> Callable[..., Awaitable[Response]]:
    async def online_request(request: Request, owner: OwnerDep) -> Response:
        return await OnlineCall(request, endpoint, owner).answer()

    return online_request


# OpenAI's envelope, or vLLM's (its `code` is the HTTP status, a number), as the engine's serving layer answers.
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            },
        }
    },
}
_ERROR = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
_DOCUMENTED = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "The request body vLLM's endpoint takes (OpenAI's, with vLLM's extra fields); "
                    "`service_tier` sets its priority against other requests and batches.",
                }
            }
        },
    }
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The engine's answer: JSON, or server-sent events for a body that asks `stream`.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    },
    400: {"description": "A body that is not a JSON object, or that the engine refuses.", **_ERROR},
    401: {"description": "No key, or an unknown one.", **_ERROR},
    404: {"description": "A model that is not served (`model_not_found`).", **_ERROR},
    413: {"description": "A body over VBATCH_MAX_JSON_BODY_BYTES.", **_ERROR},
    429: {"description": "Over the key's requests or tokens a minute (`rate_limit_exceeded`).", **_ERROR},
    503: {
        "description": "No engine serves now (`engine_unavailable`); `retry-after` says when to ask again.",
        **_ERROR,
    },
}

for _endpoint in ONLINE_ENDPOINTS:
    _name, _summary_text = _OPERATIONS[_endpoint]
    router.add_api_route(
        _endpoint,
        _route(_endpoint),
        methods=["POST"],
        name=_name,
        summary=_summary_text,
        response_class=Response,
        responses=_RESPONSES,
        openapi_extra=_DOCUMENTED,
    )
