"""How fast a running batch goes, told truthfully: output tokens as the engine generates them (vLLM's own counter,
so a first wave of long answers shows its speed before any of it finishes), requests per second over what has
finished, and no ETA until one can be estimated."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.domain.batches import Progress
from app.domain.schemas import RunStats

# A run's rate history is kept at most this many points long: past it, every other point goes (the chart keeps the
# whole run at a coarser step, in constant memory).
MAX_SAMPLES = 480
SAMPLE_SECONDS = 1.0


@dataclass(frozen=True)
class Sample:
    elapsed: float
    finished: int
    tokens: int


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
        self.samples: list[Sample] = []

    @property
    def began(self) -> bool:
        return self.done_before is not None

    def begin(self, *, done_before: int, created_ns: int) -> None:
        """The run starts sending, with `done_before` lines already done. The timeline's `created` stage is when
        the batch was created, before this start (negative): its validation and its wait for a turn."""
        self.done_before = done_before
        self.started = time.monotonic()
        self.timeline["created"] = round(min(0.0, (created_ns - time.time_ns()) / 1e9), 3)
        self._tokens_before = self._generated_tokens()
        self.samples = [Sample(0.0, done_before, 0)]

    def sample(self, progress: Progress, *, last: bool = False) -> None:
        """One point of the rate history (the console's chart); called on each checkpoint, kept a second apart,
        and once more as the run ends (`last`), so that a short run has its point too."""
        if self.done_before is None:
            return
        elapsed = self._elapsed()
        step = elapsed - self.samples[-1].elapsed
        if step < SAMPLE_SECONDS and not (last and step > 0):
            return
        self.samples.append(Sample(elapsed, progress.completed + progress.failed, self._engine_tokens(progress)))
        if len(self.samples) > MAX_SAMPLES:
            self.samples = self.samples[::2]

    def series(self) -> list[list[float]]:
        """[seconds into the run, requests/s, output tokens/s] over each step between two samples."""
        samples = self.samples  # the engine's thread may replace the list while the API's reads it
        return [
            [
                now.elapsed,
                round((now.finished - before.finished) / (now.elapsed - before.elapsed), 2),
                round((now.tokens - before.tokens) / (now.elapsed - before.elapsed), 1),
            ]
            for before, now in itertools.pairwise(samples)
        ]

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
            series=self.series(),
        )
