"""Online requests: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/responses` answered at once
by the engine that runs the batches, ahead of them.

vLLM schedules by `priority` (lower runs first, and a running request of a larger number is preempted for a smaller
one) when the engine runs with `--scheduling-policy priority`, which vbatch sets. Online requests run at 0 (OpenAI's
`service_tier` "default" or "auto"), -1 for "priority", and at the batches' own number for "flex", OpenAI's tier at
batch prices. A body's own `priority` (vLLM's field) adds to its tier's number, so it can wait longer, never jump
ahead. Batch lines run at `BATCH_PRIORITY`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from app.core.auth import ANONYMOUS
from app.core.errors import DomainError
from app.domain.errors import InvalidRequest
from app.domain.lax import flag, whole_number
from app.domain.openai_errors import error_data, openai_error
from app.domain.prefix_cache import tenant_salted

ONLINE_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Endpoints whose streams carry their usage only when `stream_options.include_usage` asks (a Responses stream always
# ends with it).
USAGE_ON_ASKING = ("/v1/chat/completions", "/v1/completions")

ONLINE_PRIORITY = 0
PRIORITY_TIER_PRIORITY = -1
BATCH_PRIORITY = 1
SERVICE_TIERS = {"auto": ONLINE_PRIORITY, "default": ONLINE_PRIORITY, "flex": BATCH_PRIORITY,
                 "priority": PRIORITY_TIER_PRIORITY}  # fmt: skip


@dataclass(frozen=True)
class OnlineRequest:
    """An online request as the API took it: its body parsed, and as sent (what a worker it is forwarded to gets, byte
    for byte), answered for `tenant` (the owner id of its key)."""

    endpoint: str
    body: dict
    raw: bytes
    tenant: str

    @classmethod
    def of(cls, endpoint: str, body: dict, *, tenant: str = ANONYMOUS) -> OnlineRequest:
        """A request made in code rather than sent (a test, a bench): its bytes are its body's JSON."""
        return cls(endpoint, body, json.dumps(body).encode(), tenant)


@dataclass(frozen=True)
class OnlineAnswer:
    """What the engine answered: a JSON body with its HTTP status, or (a body that asked `stream`) the server-sent
    events exactly as `vllm serve` writes them (each `data: ...\\n\\n`, the last `data: [DONE]\\n\\n`). Closing
    `events` before its end aborts the request in the engine."""

    status: int
    body: dict | None = None
    events: AsyncIterator[bytes] | None = None


class EngineUnavailable(DomainError):
    """No engine can answer now (starting, restarting after a death, or stopped); asking again later may help."""

    def __init__(self, state: str) -> None:
        super().__init__(f"The engine is not serving requests now (it is {state}); try again shortly.",
                         code="engine_unavailable")  # fmt: skip


def error_event(message: str, *, kind: str, code: int) -> str:
    """The event a stream ends with when it fails mid-answer, as vLLM ends one (`create_streaming_error_response`:
    its exception's class `kind`, its HTTP status `code`), with OpenAI's error object, which the client's SDK raises."""
    return error_data(openai_error(code, {"message": message, "type": kind, "param": None, "code": code}))


def online_priority(body: dict) -> int:
    """The engine priority for an online request's body, from OpenAI's `service_tier` (None: "auto")."""
    tier = body.get("service_tier")
    if tier is None:
        return ONLINE_PRIORITY
    if not isinstance(tier, str) or tier not in SERVICE_TIERS:
        raise InvalidRequest(
            f"Invalid service_tier {tier!r}: expected one of {', '.join(sorted(SERVICE_TIERS))}.",
            param="service_tier",
            code="invalid_value",
        )
    return SERVICE_TIERS[tier]


def as_online(request: OnlineRequest, *, shared_cache: bool) -> dict:
    """The body the engine is given for an online request: its priority set from `service_tier`, which vLLM does
    not know, taken out; its prefix cache its tenant's own unless `shared_cache`; a stream's usage always asked for,
    so that what it generated is known and charged (`app.domain.answers` leaves it out where the client did not ask)."""
    body = request.body
    engine_body = {key: value for key, value in body.items() if key != "service_tier"}
    engine_body["priority"] = online_priority(body) + _own_priority(body)
    options = body.get("stream_options")
    if request.endpoint in USAGE_ON_ASKING and flag(body.get("stream")) and isinstance(options, dict | None):
        # (`stream_options` of another type is left for the engine to refuse.)
        engine_body["stream_options"] = {**(options or {}), "include_usage": True}
    return engine_body if shared_cache else tenant_salted(engine_body, request.tenant)


def served_tier(body: dict) -> str:
    """The tier an answer says it was served on, as OpenAI's do: "auto" (or none asked) is served as "default"."""
    tier = body.get("service_tier")
    return tier if isinstance(tier, str) and tier in SERVICE_TIERS and tier != "auto" else "default"


def check_choices(body: dict, most: int) -> None:
    """An online request asks at most `most` choices (`n`), as a batch line may: one request of `n=1000` held the
    engine for a minute. `n` is read as vLLM reads it; one it refuses otherwise is left to its answer."""
    n = whole_number(body.get("n"))
    if n is not None and n > most:
        raise InvalidRequest(f"'n' must be an integer from 1 to {most}; it is {n}.", param="n", code="invalid_value")


def batch_line_body(*, tenant: str, by_priority: bool, shared_cache: bool) -> Callable[[dict], dict]:
    """What the engine is given for each line of a batch of `tenant`: behind every online request of the default tier
    where the engine schedules `by_priority`; its prefix cache the tenant's own unless `shared_cache`."""

    def engine_body(body: dict) -> dict:
        if by_priority:
            body = {**body, "priority": BATCH_PRIORITY + _own_priority(body)}
        return body if shared_cache else tenant_salted(body, tenant)

    return engine_body


def _own_priority(body: dict) -> int:
    """vLLM's own `priority` field as the caller set it, only ever to wait longer: no caller jumps its tier."""
    own = body.get("priority")
    return own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else 0
