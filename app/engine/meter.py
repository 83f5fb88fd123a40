"""How fast a running batch goes, told truthfully: output tokens as the engine generates them (vLLM's own counter,
so a first wave of long answers shows its speed before any of it finishes), requests per second over what has
finished, and no ETA until one can be estimated."""

from __future__ import annotations

import time
from collections.abc import Callable

from app.domain.batches import Progress
from app.domain.schemas import RunStats


class RunMeter:
    def __init__(self, *, total: int, wave: int, generated_tokens: Callable[[], int | None]) -> None:
        self.total = total
        # Lines already done when this run began (a resumed batch); None until it has begun.
        self.done_before: int | None = None
        # Until a whole wave (the requests the engine runs at once) has finished, the rate says more about the
        # wave's start than about the batch: no ETA before then.
        self.wave = max(1, min(wave, total))
        self._generated_tokens = generated_tokens
        self.started = time.monotonic()
        self._tokens_before = generated_tokens()
        # Seconds from the start of this run to each stage: where a batch's time went (planning, sending, the
        # engine, publishing).
        self.timeline: dict[str, float] = {}

    def begin(self, *, done_before: int) -> None:
        """The run starts sending, with `done_before` lines already done."""
        self.done_before = done_before
        self.started = time.monotonic()
        self._tokens_before = self._generated_tokens()

    def mark(self, stage: str) -> None:
        self.timeline.setdefault(stage, self._elapsed())

    def result(self) -> None:
        elapsed = self._elapsed()
        self.timeline.setdefault("first_result", elapsed)
        self.timeline["last_result"] = elapsed

    def _elapsed(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def _engine_tokens(self, progress: Progress) -> int:
        """Output tokens generated in this run: the engine's counter where it has one (it restarts from zero with
        a new engine), else those of finished requests."""
        now = self._generated_tokens()
        if now is None or self._tokens_before is None or now < self._tokens_before:
            self._tokens_before = now
            return progress.output_tokens
        return now - self._tokens_before

    def stats(self, progress: Progress) -> RunStats | None:
        if self.done_before is None:
            return None
        finished = progress.completed + progress.failed
        elapsed = max(time.monotonic() - self.started, 1e-6)
        finished_here = finished - self.done_before
        rate = finished_here / elapsed
        eta = (self.total - finished) / rate if finished_here >= self.wave and rate > 0 else None
        return RunStats(
            requests_per_second=round(rate, 2),
            output_tokens_per_second=round(self._engine_tokens(progress) / elapsed, 1),
            eta_seconds=None if eta is None else round(eta, 1),
            timeline=dict(self.timeline),
        )
