"""What a batch's engine time cost (issue 31). vbatch does not see vLLM's steps: it sees how long the engine had
requests in flight and the tokens each finished request used. Over each interval the engine was busy, that time
times the engine's devices is shared between whoever finished requests in it, in proportion to their tokens
(`apportion`). A request that left the engine unanswered (a batch line withdrawn for an online request, or aborted by
a cancel, an expiry or the engine's death) tells no tokens: it weighs the tokens it likely made, its seconds in
flight at the rate answered requests made tokens in the same while (`weights`), so its payer, not whoever finished
next, pays for it. An idle engine's time is charged to nobody.

A request's tokens are its prompt tokens the engine computed (those served from the prefix cache are left out: the
engine did not compute them again) plus its output tokens (`weighed_tokens`). Prices are USD per device-hour
(`VBATCH_GPU_HOUR_PRICE`); a batch's cost per million input or output tokens is its whole cost over that count, so
the two are two views of one cost, never to be added.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

Payer = TypeVar("Payer")

SECONDS_AN_HOUR = 3600.0
A_MILLION = 1_000_000


def weighed_tokens(usage: Mapping[str, object]) -> int:
    """The tokens of an answer's `usage` that engine time is shared by (chat, completions, embeddings: prompt and
    completion; responses: input and output): its uncached prompt tokens and its output tokens; 0 without usage."""
    prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
    output = _count(usage.get("completion_tokens", usage.get("output_tokens")))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
    return max(0, prompt - cached) + output


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def apportion(seconds: float, tokens: Mapping[Payer, float]) -> dict[Payer, float]:
    """`seconds` of engine time shared by the payers in proportion to their tokens; empty when none has any (the
    time is nobody's yet)."""
    total = sum(count for count in tokens.values() if count > 0)
    if total == 0:
        return {}
    return {payer: seconds * count / total for payer, count in tokens.items() if count > 0}


def weights(
    tokens: Mapping[Payer, int], answered_seconds: float, unanswered: Mapping[Payer, float]
) -> dict[Payer, float]:
    """What each payer's share of an interval goes by: the tokens of its answered requests, plus, for its
    requests that left unanswered, their `unanswered` seconds in flight times the tokens answered requests made
    a second in flight (`answered_seconds` in all). With no tokens answered, the unanswered seconds alone."""
    shares: dict[Payer, float] = {payer: float(count) for payer, count in tokens.items() if count > 0}
    made = sum(shares.values())
    if made and answered_seconds <= 0:
        return shares  # no rate to weigh unanswered requests by
    rate = made / answered_seconds if made else 1.0
    for payer, seconds in unanswered.items():
        if seconds > 0:
            shares[payer] = shares.get(payer, 0.0) + seconds * rate
    return shares


@dataclass(frozen=True)
class Spend:
    """What a batch used and, priced, cost; each figure None where it is not known."""

    gpu_seconds: float | None
    cost_usd: float | None
    cost_per_million_input_tokens: float | None
    cost_per_million_output_tokens: float | None


def spend(gpu_seconds: float | None, *, input_tokens: int, output_tokens: int, price: float | None) -> Spend:
    """`price`: USD per GPU-hour (None: unpriced, so no cost)."""
    if gpu_seconds is None or price is None:
        return Spend(None if gpu_seconds is None else round(gpu_seconds, 3), None, None, None)
    cost = gpu_seconds / SECONDS_AN_HOUR * price  # the same as `cost_usd`, unrounded for the per-million figures
    per_input, per_output = _per_million(cost, input_tokens), _per_million(cost, output_tokens)
    return Spend(round(gpu_seconds, 3), _usd(cost), _usd(per_input), _usd(per_output))


def cost_usd(gpu_seconds: float, price: float | None) -> float | None:
    """`price`: USD per GPU-hour (None: unpriced)."""
    return None if price is None else _usd(gpu_seconds / SECONDS_AN_HOUR * price)


def _per_million(cost: float, tokens: int) -> float | None:
    return cost * A_MILLION / tokens if tokens > 0 else None


def _usd(amount: float | None) -> float | None:
    """To a millionth of a dollar: finer says nothing."""
    return None if amount is None else round(amount, 6)
