"""Per-key limits on online requests: requests a minute and tokens a minute, as OpenAI's RPM and TPM.

Each limited key has a token bucket per limit, in this process (each process that answers online requests counts
on its own): it holds up to the limit, refills at limit/60 a second, and a request takes what it costs out of it.
A request costs 1 of the requests bucket, and of the tokens bucket an estimate made before the engine has seen
it, from its body read as vLLM reads it (`app.domain.lax`: `"700"` is 700): its prompt at 4 characters a token (the
text of its messages, prompt or input; a token id counts one), plus the most it may generate by the field its
endpoint reads (`max_completion_tokens` else `max_tokens` for chat, `max_tokens` for completions, `max_output_tokens`
for responses; `DEFAULT_OUTPUT_TOKENS` when unset), times `n`, times each prompt of a completions list. Once the
answer's real `usage` is known (every stream's too: its usage is always asked of the engine), the difference goes
back to (or comes out of) the bucket. Batches are not limited by these: their lines wait in the batch's own queue.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from app.core.errors import DomainError
from app.domain.lax import MOST, whole_number

CHARACTERS_A_TOKEN = 4
# What a request that sets no output limit is charged for its answer until its usage is known: most chat answers are
# shorter, and a long one is charged its real length afterwards.
DEFAULT_OUTPUT_TOKENS = 256
# Past any real request's size: a body that asks for more is charged this much, not an overflowing number.
MOST_TOKENS = MOST
# vLLM's `CompletionRequest.max_tokens` when a body leaves it out (or null).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_PROMPT_FIELDS = ("messages", "prompt", "input", "instructions")
_NAMES = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


@dataclass(frozen=True)
class Limits:
    """A key's limits a minute (0: none)."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0


@dataclass(frozen=True)
class Allowance:
    """What one limit leaves a key now: OpenAI's `x-ratelimit-*-requests` (or `-tokens`) headers."""

    limit: int
    remaining: int
    reset_seconds: float  # until the bucket is full again


@dataclass(frozen=True)
class Quota:
    """A key's allowances now (None: that limit is not set)."""

    requests: Allowance | None = None
    tokens: Allowance | None = None


class RateLimited(DomainError):
    """Over a limit: OpenAI's 429 of type "requests" or "tokens". `retry_after_seconds` None: this request can
    never pass (it alone costs more tokens than the limit)."""

    def __init__(self, message: str, *, kind: str, retry_after_seconds: float | None, quota: Quota) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.kind = kind
        self.retry_after_seconds = retry_after_seconds
        self.quota = quota


@dataclass
class Admission:
    """A request let through: what it was charged, so that its real usage can settle the difference."""

    owner: str
    tokens_charged: int
    quota: Quota


class _Bucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = per_minute
        self.level = float(per_minute)
        self.per_second = per_minute / 60
        self.at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_second)
        self.at = now

    def wait_for(self, cost: int) -> float:
        return max(0.0, (cost - self.level) / self.per_second)

    def allowance(self) -> Allowance:
        remaining = max(0, math.floor(self.level))
        return Allowance(self.capacity, remaining, max(0.0, (self.capacity - self.level) / self.per_second))


class RateLimiter:
    """Every key's buckets, safe to use from any thread. `by_owner`: keys with limits of their own (owner id ->
    settings from the keys file, `live_rpm` / `live_tpm`); every other key has `default`."""

    def __init__(
        self, default: Limits, by_owner: dict[str, Limits], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.default = default
        self.by_owner = by_owner
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    @classmethod
    def from_settings(cls, *, rpm: int, tpm: int, key_settings: dict[str, dict[str, int]]) -> RateLimiter:
        """The service's limits, and each key's own from the keys file (a setting a key's line leaves out is the
        service's)."""
        default = Limits(rpm, tpm)
        by_owner = {
            owner: Limits(own.get("live_rpm", rpm), own.get("live_tpm", tpm)) for owner, own in key_settings.items()
        }
        return cls(default, by_owner)

    def limits_of(self, owner: str) -> Limits:
        return self.by_owner.get(owner, self.default)

    def admit(self, owner: str, *, tokens: int, model: str) -> Admission:
        """Charges a request of `tokens` (estimated) to `owner`; raises RateLimited, charging nothing, when either
        limit has not room for it now."""
        with self._lock:
            buckets = self._buckets_of(owner)
            requests, token_bucket = buckets.get("requests"), buckets.get("tokens")
            if requests is not None and requests.level < 1:
                raise self._refused("requests", requests, 1, model, owner)
            if token_bucket is not None and (tokens > token_bucket.capacity or token_bucket.level < tokens):
                raise self._refused("tokens", token_bucket, tokens, model, owner)
            if requests is not None:
                requests.level -= 1
            if token_bucket is not None:
                token_bucket.level -= tokens
            return Admission(owner, tokens if token_bucket is not None else 0, self._quota(owner))

    def settle(self, admission: Admission, *, tokens_used: int) -> Quota:
        """The request's real cost is known (its answer's usage): the bucket gets back what was charged too much,
        or gives what was charged too little (it may go below 0: the key waits the longer). The allowance of
        requests stays as the request left it: an answer's headers count the request they answer, however much
        the bucket refilled while it ran."""
        with self._lock:
            bucket = self._buckets_of(admission.owner).get("tokens")
            if bucket is not None and admission.tokens_charged:
                bucket.level = min(bucket.capacity, bucket.level + admission.tokens_charged - tokens_used)
                admission.tokens_charged = 0
            return replace(self._quota(admission.owner), requests=admission.quota.requests)

    def quota(self, owner: str) -> Quota:
        with self._lock:
            self._buckets_of(owner)
            return self._quota(owner)

    def _buckets_of(self, owner: str) -> dict[str, _Bucket]:
        """The key's buckets by kind, refilled to now (made at their first use); only its limits that are set."""
        limits = self.limits_of(owner)
        now = self.clock()
        buckets = {}
        for kind, per_minute in (("requests", limits.requests_per_minute), ("tokens", limits.tokens_per_minute)):
            if per_minute:
                bucket = self._buckets.get((owner, kind))
                if bucket is None:
                    bucket = self._buckets[(owner, kind)] = _Bucket(per_minute, now)
                bucket.refill(now)
                buckets[kind] = bucket
        return buckets

    def _quota(self, owner: str) -> Quota:
        requests, tokens = self._buckets.get((owner, "requests")), self._buckets.get((owner, "tokens"))
        return Quota(
            requests.allowance() if requests is not None else None, tokens.allowance() if tokens is not None else None
        )

    def _refused(self, kind: str, bucket: _Bucket, cost: int, model: str, owner: str) -> RateLimited:
        quota = self._quota(owner)
        where = f"for {model} on {_NAMES[kind]} for this API key"
        if cost > bucket.capacity:
            return RateLimited(
                f"Request too large {where}: Limit {bucket.capacity}, Requested {cost}. The input or output tokens "
                "must be reduced in order to run successfully.",
                kind=kind,
                retry_after_seconds=None,
                quota=quota,
            )
        wait = bucket.wait_for(cost)
        used = max(0, math.ceil(bucket.capacity - bucket.level))
        return RateLimited(
            f"Rate limit reached {where}: Limit {bucket.capacity}, Used {used}, Requested {cost}. "
            f"Please try again in {duration(wait)}.",
            kind=kind,
            retry_after_seconds=wait,
            quota=quota,
        )


def duration(seconds: float) -> str:
    """OpenAI's spelling of a wait (Go's): "120ms", "8.64s", "6m0s", "1h2m3s"."""
    milliseconds = max(0, math.ceil(seconds * 1000))
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def estimated_tokens(endpoint: str, body: dict) -> int:
    """What a request is charged before its usage is known, read as vLLM's request models read its body (numbers in
    strings, whole floats): its prompt at `CHARACTERS_A_TOKEN` characters a token (a token id counts one), plus the
    most each of its prompts may generate for each of its `n` choices (`DEFAULT_OUTPUT_TOKENS` where the endpoint
    has no fixed default); an embedding generates nothing. Whatever the body holds, this is a number, never an
    error: a body the engine refuses is settled at nothing once refused."""
    characters, token_ids = _prompt_size([body.get(field) for field in _PROMPT_FIELDS])
    prompt = math.ceil(characters / CHARACTERS_A_TOKEN) + token_ids
    output = 0 if endpoint == "/v1/embeddings" else _output_tokens(endpoint, body) * _choices(body) * _prompts(body)
    return min(MOST_TOKENS, prompt + output)


def _prompt_size(values: list[object]) -> tuple[int, int]:
    """Characters of every string, and how many integers (token ids), anywhere in `values`; a loop, not a recursion,
    so no nesting is too deep for it."""
    characters = token_ids = 0
    waiting = list(values)
    while waiting:
        value = waiting.pop()
        if isinstance(value, str):
            characters += len(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            token_ids += 1
        elif isinstance(value, dict):
            waiting.extend(value.values())
        elif isinstance(value, list):
            waiting.extend(value)
    return characters, token_ids


def _output_tokens(endpoint: str, body: dict) -> int:
    """The most one choice may generate, by the field vLLM reads for `endpoint`: chat's `max_completion_tokens` when
    set, else its `max_tokens`; completions' `max_tokens` (16 unset); responses' `max_output_tokens`."""
    if endpoint == "/v1/completions":
        limit = whole_number(body.get("max_tokens"))
        return COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else limit
    if endpoint == "/v1/responses":
        limit = whole_number(body.get("max_output_tokens"))
    else:
        limit = whole_number(body.get("max_completion_tokens"))
        if limit is None:
            limit = whole_number(body.get("max_tokens"))
    return DEFAULT_OUTPUT_TOKENS if limit is None else limit


def _choices(body: dict) -> int:
    """`n` as vLLM reads it (one unset); an `n` it would refuse is charged as one, and refused."""
    n = whole_number(body.get("n"))
    return n if n is not None and n >= 1 else 1


def _prompts(body: dict) -> int:
    """The prompts a completions request answers each: a list of texts, or of lists of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(item, str | list) for item in prompt):
        return len(prompt)
    return 1


def used_tokens(usage: object) -> int | None:
    """The tokens an answer's `usage` says it took (chat and completions: prompt + completion; responses: input +
    output; embeddings: prompt), or None when there is no such usage."""
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool):
        return total
    parts = [usage.get(name) for name in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")]
    numbers = [part for part in parts if isinstance(part, int) and not isinstance(part, bool)]
    return sum(numbers) if numbers else None


def output_tokens(usage: object) -> int | None:
    """The generated tokens an answer's `usage` counts (None: it does not say)."""
    if not isinstance(usage, dict):
        return None
    for name in ("completion_tokens", "output_tokens"):
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
