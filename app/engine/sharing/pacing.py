"""Batch lines enter the engine paced by their prompt tokens while live requests are about (issue 39).

Why. A live request's first token costs its own prefill, plus the rest of the engine step running when it arrives
(vLLM cannot stop a step), plus the batch tokens that share its step. vbatch starts the engine with `LLM`-class
defaults (16,384 batched tokens a step on an H100), so a step that carries a full budget of batch prefill (a new
batch's first wave, a refill after a wave ends together) takes hundreds of milliseconds on an 8B model, and seconds
on a CPU. Free slots (the window, `app.engine.sharing.window`) do not bound that; the prompt tokens handed over do.

The rule. While the window says live traffic is about (`active`), the batch lines handed to the engine carry at
most `budget()` prompt tokens per engine step: each step the engine reports (`on_step`) gives the pace that many
tokens again (what a step leaves unused is not kept), and a line waits, in order, until its tokens fit (a line
larger than the whole budget goes alone, and the steps after pay for it). With no step reported for a while (an idle
engine reports none) the pace refills on its own after about a step, and after `IDLE_FORGIVE_SECONDS` with its debt
forgiven: a batch never waits on the pace of an engine that runs nothing. The budget is `VBATCH_LIVE_PREFILL_TOKENS`, or
derived: the batch's part of a step a live request waits on is held to `LIVE_STEP_SHARE` of the live TTFT target
(50 ms of the default 500), and what the engine's fitted step cost (`app.engine.telemetry.steps`) says its decode
already takes of that (its last step's, while steps come) leaves the prompt tokens that fit (at least one line a step:
the batch always progresses), never more than the engine's own step budget. With data-parallel ranks each rank's step
refills it.

A new batch's first wave (the first `wave` lines a run hands over, `ramp`) is paced whatever the traffic, at no
less than an eighth of the engine's step budget, nor than 512 tokens a step: a live request may arrive at any
moment, and the step that would carry the whole wave at once cannot be stopped (on a CPU, 4,096 prompt tokens in
2.5 s). An engine whose step budget is no larger is not paced so: it bounds its steps itself, and lines handed to it
a step at a time would come a step late. Once the wave is in, a batch with no live traffic about refills at full
pace. What that costs a batch alone on a CPU: docs/benchmarks.md (issue 39).

Room in the KV cache. While pacing, a line also waits while the engine's KV cache (its last reported use, if
recent) has less free room than its prompt plus the room kept for live requests (`live_reserve`: those in flight
and those likely to arrive before the next tick), so a live request is not the one that waits for blocks.

Prompt tokens are estimated from a body's characters (`estimated_tokens`), corrected by what the engine reported
for the lines answered so far (their prompt tokens less the cached ones): counting them exactly would cost a
tokenizer call per line on the engine's loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from app.domain.input_index import leading_text
from app.engine.inference.serving import EngineStep
from app.engine.telemetry.steps import EngineSteps

# The batch's part of a step a live request waits on, as a share of the live TTFT target: a first token waits on
# about two steps (the one running when it arrives, and its own), so two such parts leave most of the target to the
# request's own prefill, the decode of what runs beside it and its way through the API.
LIVE_STEP_SHARE = 0.1
# A new batch's first wave enters at no less than this share of the engine's step budget a step, and no less than
# `MIN_RAMP_TOKENS`: an engine given a small step budget bounds its steps itself.
RAMP_SHARE = 1 / 8
MIN_RAMP_TOKENS = 512
CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS = 8  # what a chat template adds around each message, about
# While the engine has reported no step: how often the pace refills.
DEFAULT_STEP_SECONDS = 0.05
# The pace refills on its own after this many of the last step's seconds without a report (an idle engine).
IDLE_STEPS = 2.0
MIN_REFILL_SECONDS, MAX_REFILL_SECONDS = 0.005, 1.0
# The last step's KV cache use and decode count only this long (an idle engine reports none).
STEP_FRESH_SECONDS = 1.0
# With no step reported this long, what a line larger than the budget left owing is forgiven: the engine is idle, so
# its prefill is done (the steps that would pay for it never come, and a debt paid a refill at a time held a 1-line
# batch 600 s behind a budget of one token, derived from a decode long finished).
IDLE_FORGIVE_SECONDS = 2.0
# The estimate's correction moves this far towards each answered line's own ratio.
CALIBRATION_WEIGHT = 0.02


class PaceNumbers(NamedTuple):
    """What /metrics and the console show of the pacing."""

    active: bool  # live traffic about: batch lines paced
    budget_tokens: int  # batch prompt tokens a step while paced
    handed_tokens: int  # batch prompt tokens let in while paced (estimated), since the engine started
    waited: int  # times a line waited for the next step


def estimated_tokens(body: dict) -> int:
    """A body's prompt tokens, roughly: its text's characters over `CHARS_PER_TOKEN`, and a chat template's tokens
    around each message."""
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    return max(1, math.ceil(len(leading_text(body)) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS * count)


class PrefillPacer:
    """See the module. Used on the engine loop; `budget` and `active` may be read from any thread."""

    def __init__(
        self,
        *,
        steps: EngineSteps,
        ttft_target_seconds: float,
        max_step_tokens: int,
        budget_tokens: int = 0,
        live_reserve: Callable[[], int] = lambda: 0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.steps = steps
        self.ttft_target_seconds = ttft_target_seconds
        self.max_step_tokens = max(1, max_step_tokens)
        self.budget_tokens = budget_tokens  # VBATCH_LIVE_PREFILL_TOKENS; 0: derived
        self.live_reserve = live_reserve
        self._now = now
        self.active = False
        self.ratio = 1.0  # engine tokens per estimated token, learned from answered lines
        self.handed = 0  # prompt tokens handed over while pacing (estimated), since the engine started
        self.waited = 0  # times a line waited for the pace's next refill
        self._allowance = 0
        self._refilled_at = -math.inf
        self._refilled = asyncio.Event()
        self.refusals = 0  # times a line did not fit the step
        self._last_step_seconds: float | None = None
        self._last_step_at = -math.inf
        steps.listen(self.on_step)

    def numbers(self) -> PaceNumbers:
        """From any thread."""
        return PaceNumbers(self.active, self.budget(), self.handed, self.waited)

    # What the window and the engine say.

    def activate(self, active: bool) -> None:
        """Live traffic about (True) or gone quiet (False): the window says so each tick, and only a change moves the
        pace. It starts afresh when live traffic comes, and when it goes at a first wave's pace with nothing owed (a
        debt run up under the live budget is not the first wave's to pay). A waiting line is woken by a refill
        only: woken each tick without one, it would never reach the refill it waits for on its own."""
        if active == self.active:
            return
        self.active = active
        if active:
            self._refill(self.budget())
        else:
            self._refill(self.ramp_budget(), forgive=True)

    def on_step(self, step: EngineStep) -> None:
        self._last_step_seconds = step.seconds
        self._last_step_at = self._now()
        self._refill(self._pacing_now())

    # The budget.

    def budget(self) -> int:
        """Batch prompt tokens a step while live traffic is about."""
        if self.budget_tokens > 0:
            return self.budget_tokens
        return max(1, min(self.max_step_tokens, self._derived()))

    def ramp_budget(self) -> int:
        ramp = max(int(self.max_step_tokens * RAMP_SHARE), min(MIN_RAMP_TOKENS, self.max_step_tokens))
        return max(self.budget(), ramp)

    def _derived(self) -> int:
        costs = self.steps.costs()
        if costs.per_prefill is None or costs.per_prefill <= 0:
            # No step measured yet: an eighth of the engine's step budget, as a new batch's first wave.
            return int(self.max_step_tokens * RAMP_SHARE)
        batch_seconds = self.ttft_target_seconds * LIVE_STEP_SHARE
        last = self.steps.last() if self._stepping() else None
        decoding = (costs.per_decode or 0.0) * (last.decode_tokens if last is not None else 0)
        return int(max(0.0, batch_seconds - decoding) / costs.per_prefill)

    # The lines.

    def estimate(self, body: dict) -> int:
        return max(1, round(estimated_tokens(body) * self.ratio))

    def fits(self, tokens: int, *, ramp: bool = False) -> bool:
        """Whether a line of `tokens` prompt tokens (one of a first wave: `ramp`) may enter the engine now; True at
        once unless pacing. The lines ask in their order (`app.engine.sharing.execution`): one that does not fit is
        held, and the lines after it wait behind it."""
        if not self._pacing(ramp):
            return True
        if self._fits(tokens, self._pacing_now()):
            return True
        self.refusals += 1
        return False

    def take(self, tokens: int, *, ramp: bool = False) -> None:
        """The line that fits enters: its tokens count against this step's budget."""
        if self._pacing(ramp):
            self._allowance -= tokens
            self.handed += tokens

    async def opened(self) -> None:
        """Returns at the next refill: the next step the engine reports, or, with none for about two steps (an idle
        engine reports none), on its own."""
        self.waited += 1
        refilled_at = self._refilled_at
        self._refilled.clear()
        try:
            await asyncio.wait_for(self._refilled.wait(), timeout=self._refill_after())
        except TimeoutError:
            if self._refilled_at == refilled_at:  # one refill for every line that waited for it
                self._refill(self._pacing_now(), forgive=self._now() - self._last_step_at >= IDLE_FORGIVE_SECONDS)

    def _pacing(self, ramp: bool) -> bool:
        # A target of 0 turns the live protections off, a first wave's pace with them; an engine whose own step budget
        # is no more than a first wave's bounds its steps itself (handed a step at a time, lines would come late).
        if self.ttft_target_seconds <= 0:
            return False
        return self.active or (ramp and self.ramp_budget() < self.max_step_tokens)

    def _pacing_now(self) -> int:
        """The budget in force: the live one, or a first wave's while no live traffic is about."""
        return self.budget() if self.active else self.ramp_budget()

    def _fits(self, tokens: int, budget: int) -> bool:
        if self._refilled_at == -math.inf:
            self._refill(budget)
        if not self._kv_room(tokens):
            return False
        return self._allowance >= tokens or self._allowance >= budget

    def _kv_room(self, tokens: int) -> bool:
        usage, size = self.steps.kv_usage, self.steps.kv_tokens
        if usage is None or not size or not self._stepping():
            return True
        return (1.0 - usage) * size - self.live_reserve() >= tokens

    def _refill_after(self) -> float:
        step = self._last_step_seconds or DEFAULT_STEP_SECONDS
        return min(MAX_REFILL_SECONDS, max(MIN_REFILL_SECONDS, IDLE_STEPS * step))

    def _stepping(self) -> bool:
        """Whether the engine reported a step lately."""
        return self._now() - self._last_step_at <= STEP_FRESH_SECONDS

    def _refill(self, budget: int, *, forgive: bool = False) -> None:
        """A step's worth again; a debt (a line larger than what was left) is paid first, unless `forgive`n."""
        if forgive or self._refilled_at == -math.inf:
            self._allowance = budget
        else:
            self._allowance = min(budget, self._allowance + budget)
        self._refilled_at = self._now()
        self._refilled.set()

    def answered(self, body: dict, usage: dict | None) -> None:
        """A line has its answer, whose `usage` (prompt tokens less the cached ones) corrects the estimate."""
        prompt = (usage or {}).get("prompt_tokens")
        if not isinstance(prompt, int) or prompt <= 0:
            return
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        computed = max(1, prompt - (cached if isinstance(cached, int) else 0))
        self.ratio += CALIBRATION_WEIGHT * (computed / estimated_tokens(body) - self.ratio)
