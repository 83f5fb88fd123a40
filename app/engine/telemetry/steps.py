"""The engine's steps as vLLM reports them (`serving.EngineStep`): what /metrics and the console's engine page say of
them, and the cost of a step that the batch's pacing (`app.engine.sharing.pacing`) reads.

A step's time is the model's run of it (vLLM's iteration details, which vbatch turns on; with vLLM's async
scheduling on a GPU, the CPU work of the next step overlaps it and is not counted). vLLM counts a step's prompt
tokens without saying whose they are; they are split here. Online requests arrive with an estimate of their prompt
(`online_arrived`) and, under vbatch's priority policy, the engine lets them in before any waiting batch line, so
each step's prompt tokens first pay for the online prompts that arrived before it and the rest is the batch's.

The cost of a step: least squares of its seconds on its prompt and decode tokens over the last `FIT_STEPS` steps,
`fixed + per_prefill x prompt + per_decode x decode`. A coefficient the recent steps cannot tell (no spread in that
kind of token) keeps its last fitted value; one never fitted is None.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from app.engine.inference.serving import EngineStep

# The console's numbers are over the steps of the last this many seconds.
RECENT_SECONDS = 10.0
# Steps the cost of a step is fitted on: a few seconds of a busy engine, under a second of a big one.
FIT_STEPS = 512
MIN_FIT_STEPS = 16
# Fitted again at most this often: the pacing reads the cost at every step.
FIT_EVERY_SECONDS = 0.25
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Token kinds of `vbatch_engine_step_tokens_total`.
BATCH_PREFILL, LIVE_PREFILL, DECODE = "batch_prefill", "live_prefill", "decode"
# An online prompt no step has computed this long after it arrived never will (refused before the engine, or
# aborted): it is no longer counted against the steps' prompt tokens.
LIVE_OWED_SECONDS = 10.0


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a step: `fixed`, plus `per_prefill` a prompt token and `per_decode` a decoded one (None: not
    known yet)."""

    fixed: float | None
    per_prefill: float | None
    per_decode: float | None


@dataclass(frozen=True)
class StepSummary:
    """The steps of the last `RECENT_SECONDS`, for the console: how many, how long, and what each carried on
    average."""

    steps: int
    per_second: float
    seconds_p50: float
    seconds_p90: float
    seconds_max: float
    batch_prefill: float
    live_prefill: float
    decode: float
    kv_usage: float | None


@dataclass(frozen=True)
class _Seen:
    at: float
    step: EngineStep
    batch_prefill: int
    live_prefill: int


class EngineSteps(Collector):
    """Every step the engine reports (`record`, on the engine loop), and what online requests arrived with
    (`online_arrived`). Read from any thread: `summary`, `costs`, a scrape."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._recent: deque[_Seen] = deque(maxlen=max(FIT_STEPS, 4096))
        # Online prompts that arrived and that no step has computed yet: [when, tokens left], oldest first.
        self._live_owed: deque[list] = deque()
        self._count = 0
        self._seconds = 0.0
        self._buckets = [0] * len(STEP_BUCKETS)
        self._tokens = {BATCH_PREFILL: 0, LIVE_PREFILL: 0, DECODE: 0}
        self._costs = StepCosts(None, None, None)
        self._fitted_at = -math.inf
        self._listeners: list[Callable[[EngineStep], None]] = []
        self.kv_usage: float | None = None
        self.kv_tokens: int | None = None

    def listen(self, listener: Callable[[EngineStep], None]) -> None:
        """`listener` hears of each step after it is recorded (on the engine loop)."""
        self._listeners.append(listener)

    def online_arrived(self, prompt_tokens: int) -> None:
        with self._lock:
            if prompt_tokens > 0:
                self._live_owed.append([self._now(), prompt_tokens])

    def record(self, step: EngineStep) -> None:
        with self._lock:
            live = self._pay_live(step.prefill_tokens)
            self._recent.append(_Seen(self._now(), step, step.prefill_tokens - live, live))
            self._count += 1
            self._seconds += step.seconds
            index = bisect.bisect_left(STEP_BUCKETS, step.seconds)
            if index < len(self._buckets):
                self._buckets[index] += 1
            self._tokens[BATCH_PREFILL] += step.prefill_tokens - live
            self._tokens[LIVE_PREFILL] += live
            self._tokens[DECODE] += step.decode_tokens
            if step.kv_usage is not None:
                self.kv_usage = step.kv_usage
            if step.kv_tokens:
                self.kv_tokens = step.kv_tokens
        for listener in self._listeners:
            listener(step)

    def _pay_live(self, prompt_tokens: int) -> int:
        """Of a step's prompt tokens, those of the online prompts that arrived before it (oldest first)."""
        since = self._now() - LIVE_OWED_SECONDS
        while self._live_owed and self._live_owed[0][0] < since:
            self._live_owed.popleft()
        paid = 0
        while self._live_owed and paid < prompt_tokens:
            owed = self._live_owed[0]
            part = min(owed[1], prompt_tokens - paid)
            paid, owed[1] = paid + part, owed[1] - part
            if owed[1] == 0:
                self._live_owed.popleft()
        return paid

    @property
    def count(self) -> int:
        return self._count

    def last(self) -> EngineStep | None:
        with self._lock:
            return self._recent[-1].step if self._recent else None

    def costs(self) -> StepCosts:
        """The cost of a step, fitted again at most every `FIT_EVERY_SECONDS`."""
        now = self._now()
        with self._lock:
            if now - self._fitted_at >= FIT_EVERY_SECONDS:
                self._fitted_at = now
                steps = [seen.step for seen in list(self._recent)[-FIT_STEPS:]]
                self._costs = fitted(steps, self._costs)
            return self._costs

    def summary(self) -> StepSummary | None:
        """None: no step in the last `RECENT_SECONDS`."""
        since = self._now() - RECENT_SECONDS
        with self._lock:
            recent = [seen for seen in self._recent if seen.at >= since]
            kv_usage = self.kv_usage
        if not recent:
            return None
        seconds = sorted(seen.step.seconds for seen in recent)
        count = len(recent)

        def quantile(q: float) -> float:
            return seconds[min(count - 1, math.ceil(q * count) - 1)]

        return StepSummary(
            steps=count,
            per_second=count / RECENT_SECONDS,
            seconds_p50=quantile(0.5),
            seconds_p90=quantile(0.9),
            seconds_max=seconds[-1],
            batch_prefill=sum(seen.batch_prefill for seen in recent) / count,
            live_prefill=sum(seen.live_prefill for seen in recent) / count,
            decode=sum(seen.step.decode_tokens for seen in recent) / count,
            kv_usage=kv_usage,
        )

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        with self._lock:
            count, seconds, buckets, tokens = self._count, self._seconds, list(self._buckets), dict(self._tokens)
        yield CounterMetricFamily(
            "vbatch_engine_steps", "Engine steps the engine reported (vLLM's iteration details).", value=count
        )
        cumulative, running = [], 0
        for bound, seen in zip(STEP_BUCKETS, buckets, strict=True):
            running += seen
            cumulative.append((str(bound), running))
        cumulative.append(("+Inf", count))
        yield HistogramMetricFamily(
            "vbatch_engine_step_seconds",
            "The model's run of each engine step: what a live request waits for when it arrives mid-step, and what its "
            "own first step takes.",
            buckets=cumulative,
            sum_value=seconds,
        )
        family = CounterMetricFamily(
            "vbatch_engine_step_tokens",
            "Tokens the engine computed in its steps: batch_prefill and live_prefill (prompt tokens, split by the "
            "online prompts that arrived first, estimated from their characters) and decode.",
            labels=["kind"],
        )
        for kind in (BATCH_PREFILL, LIVE_PREFILL, DECODE):
            family.add_metric([kind], tokens[kind])
        yield family


def fitted(steps: list[EngineStep], known: StepCosts) -> StepCosts:
    """Least squares of the steps' seconds on (1, prompt tokens, decode tokens); a coefficient the steps cannot tell
    (too few steps, no spread in its tokens, a fit below zero) keeps its value in `known`."""
    if len(steps) < MIN_FIT_STEPS:
        return known
    n = len(steps)
    mean_t = sum(s.seconds for s in steps) / n
    mean_p = sum(s.prefill_tokens for s in steps) / n
    mean_d = sum(s.decode_tokens for s in steps) / n
    spp = sdd = spd = spt = sdt = 0.0
    for s in steps:
        p, d, t = s.prefill_tokens - mean_p, s.decode_tokens - mean_d, s.seconds - mean_t
        spp, sdd, spd, spt, sdt = spp + p * p, sdd + d * d, spd + p * d, spt + p * t, sdt + d * t
    per_prefill, per_decode = _solve(spp, sdd, spd, spt, sdt)
    prefill = per_prefill if per_prefill is not None else known.per_prefill
    decode = per_decode if per_decode is not None else known.per_decode
    fixed = mean_t - (prefill or 0.0) * mean_p - (decode or 0.0) * mean_d
    return StepCosts(max(0.0, fixed), prefill, decode)


def _solve(spp: float, sdd: float, spd: float, spt: float, sdt: float) -> tuple[float | None, float | None]:
    """(per prompt token, per decode token) from the centred sums; None where the steps have no spread to tell."""
    spread_p, spread_d = spp > 1e-9, sdd > 1e-9
    det = spp * sdd - spd * spd
    if spread_p and spread_d and det > 1e-6 * spp * sdd:
        p, d = (spt * sdd - sdt * spd) / det, (sdt * spp - spt * spd) / det
        if p >= 0 and d >= 0:
            return p, d
        # Noise drove one below zero: the steps do not tell that one (it keeps its last value); the other is
        # fitted alone.
        if p < 0:
            return None, max(0.0, sdt / sdd)
        return max(0.0, spt / spp), None
    return (max(0.0, spt / spp) if spread_p else None), (max(0.0, sdt / sdd) if spread_d else None)
