"""Online requests: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `/v1/responses` answered at once
by the engine that runs the batches, ahead of them.

vLLM schedules by `priority` (lower runs first, and a running request of a larger number is preempted for a smaller
one) when the engine runs with `--scheduling-policy priority`, which vbatch sets. Online requests run at 0 (OpenAI's
`service_tier` "default" or "auto"), -1 for "priority", and at the batches' own number for "flex", OpenAI's tier at
batch prices. A body's own `priority` (vLLM's field) adds to its tier's number, so it can wait longer, never jump
ahead. Batch lines run at `BATCH_PRIORITY`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.core.errors import DomainError
from app.domain.errors import InvalidRequest
from app.domain.openai_errors import error_data, openai_error

ONLINE_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")

ONLINE_PRIORITY = 0
PRIORITY_TIER_PRIORITY = -1
BATCH_PRIORITY = 1
SERVICE_TIERS = {"auto": ONLINE_PRIORITY, "default": ONLINE_PRIORITY, "flex": BATCH_PRIORITY,
                 "priority": PRIORITY_TIER_PRIORITY}  # fmt: skip


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


def as_online(body: dict) -> dict:
    """The body the engine is given for an online request: its priority set from `service_tier`, which vLLM does
    not know, taken out."""
    engine_body = {key: value for key, value in body.items() if key != "service_tier"}
    engine_body["priority"] = online_priority(body) + _own_priority(body)
    return engine_body


def as_batch_line(body: dict) -> dict:
    """The body the engine is given for a batch line: behind every online request of the default tier."""
    return {**body, "priority": BATCH_PRIORITY + _own_priority(body)}


def _own_priority(body: dict) -> int:
    """vLLM's own `priority` field as the caller set it, only ever to wait longer: no caller jumps its tier."""
    own = body.get("priority")
    return own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else 0
