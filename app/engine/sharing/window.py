"""The batch's in-flight window: how many batch lines vbatch keeps in the engine at once, which gives way to online
requests (`app.domain.online`) while they need room and takes every slot back once they stop.

Why a window on top of priorities. vLLM's v1 scheduler (vllm 0.32, `vllm/v1/core/sched/scheduler.py`,
`Scheduler.schedule`) admits a waiting request only while `len(self.running)` is below `max_num_active_reqs`
(max_num_seqs unless `max_num_active_seqs` is set): the loop "Next, schedule the WAITING requests" breaks at
`num_running >= self.max_num_active_reqs`. Under `--scheduling-policy priority` the waiting queue is a
`PriorityRequestQueue` ordered by (priority, arrival time), so an online request is the first waiting one let in,
but only once a running slot frees: it preempts nobody for a slot. Priority preemption happens in one place, when
`kv_cache_manager.allocate_slots` finds no KV block for a request already running; the victim is
`max(self.running, key=lambda r: (r.priority, r.arrival_time))`, a batch line before any online request of the
default or priority tier. A waiting
request that finds no block just waits (`break`), no waiting request is admitted in a step that preempted, and the
running requests take the step's token budget before any waiting prefill. So with every max_num_seqs slot held by
batch lines, an online request waits for a batch line to finish, however good its priority. The window, at most
`max_in_flight` (two waves by default: one running, one queued in the engine), leaves running slots free while
online traffic needs them, and only then.

The rule, applied every `TICK_SECONDS` on the engine loop from what the online path reports (`online_arrived`,
`online_first_token`, `online_done`):
- no online request in flight nor arrived in the last `QUIET_SECONDS`: the window is `max_in_flight` at once, the
  batch filling every idle slot;
- else it is held under its ceiling: one wave less room for online requests (twice those in flight: their own
  slots, and as many free for those arriving before the next tick; at least `grow_step`). Above a wave, batch lines
  queue in the engine and hold every running slot; measured on an H100 (docs/benchmarks.md, issue 29), with answers
  of one length the slots then free in waves, and an online request waited for the next wave: seconds;
- under the ceiling, the `PERCENTILE` time to first token of the online requests whose first token came in the last
  `RECENT_SECONDS` and that arrived after the window last shrank (a shrink is judged only on requests that came
  after it), above the target: the window shrinks by `SHRINK`;
- at or under the target: it grows by `grow_step` (a sixteenth of a wave) a tick, up to the ceiling; with no such
  request measured yet it holds, unless no online request has arrived for `QUIET_SECONDS` (only long ones left
  running), when it grows.
It never goes below an eighth of a wave (`least`), so batches always progress. Shrinking cancels nothing: lines in
flight finish, and fewer start.

The ceiling also holds the batch's decode in a step to its part of a step a live request waits on (the pacing's
`LIVE_STEP_SHARE` of the target, `app.engine.sharing.pacing`): the most batch lines whose decode, at what the engine's
fitted step cost says a decoded token takes (`app.engine.telemetry.steps`), fits in it. On a GPU a step decodes a wave
for little more than one sequence (measured on an H100: ~40 ms for ~960 lines), and this bound is above a wave; on a CPU
each sequence costs milliseconds (2 cores, SmolLM2: ~3.4 ms, 0.72 s a step for 200 lines), and it keeps the batch to
its least while live requests are about. Beside the window, the pacing bounds the prompt tokens batch lines bring
into each step (`pacer`); the window tells it when live traffic is about.

Room at once. A tick comes a quarter second late, and shrinking frees no running slot: measured on an H100
(docs/benchmarks.md, issue 29, second run), an online request that came while the engine held two waves of batch
lines waited for one of them to end, seconds. So an online request that arrives when the batch lines held and the
online requests in flight are more than a wave withdraws the difference at once, youngest first
(`execution.Place.withdraw`): the lines queued in the engine beyond its running slots, which have cost nothing yet,
then the running ones that started last, whose work is lost (a prompt's prefill mostly comes back from the prefix
cache), never below `least`, so batches still progress under any online load. Each runs again once it has a place
again. This is the preemption vLLM does not do for a slot, and the
window is held under its ceiling at once too, so the lines withdrawn do not come straight back. The lines beyond
the decode bound above go the same way at once: a live request that arrives as a batch starts on a CPU (its lines
just in, mostly still unprefilled) does not wait behind a step of all of them.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import NamedTuple

from app.core import clock
from app.engine.sharing.execution import Place
from app.engine.sharing.pacing import LIVE_STEP_SHARE, PrefillPacer, estimated_tokens

TICK_SECONDS = 0.25
QUIET_SECONDS = 3.0
RECENT_SECONDS = 5.0
PERCENTILE = 0.9
SHRINK = 0.5
# Recent first-token times kept at most: enough for a percentile under a thousand concurrent streams.
MAX_SAMPLES = 4096
# An online request's output when it names no limit, for the KV cache room kept for live requests.
DEFAULT_LIVE_OUTPUT = 256


class WindowSize(NamedTuple):
    """The window now and the most it may be (`max_in_flight`): what the console and /metrics show."""

    size: int
    max_size: int


class OnlineTraffic:
    """What the window knows of online requests: how many are in flight, when the last one arrived, and the time to
    first token of those whose first token came in the last `RECENT_SECONDS`."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.in_flight = 0
        self.last_arrival = -math.inf
        self._first_tokens: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when it came, seconds)
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)  # (when, KV tokens it may take)

    def arrived(self, kv_tokens: int = 0) -> None:
        self.in_flight += 1
        self.last_arrival = self._now()
        self._arrivals.append((self.last_arrival, kv_tokens))

    def kv_reserve(self, ahead_seconds: float) -> int:
        """KV cache tokens for the online requests in flight and those likely to arrive in `ahead_seconds` (at the
        rate of the last `RECENT_SECONDS`), each at the mean of what recent ones may take."""
        while self._arrivals and self._arrivals[0][0] < self._now() - RECENT_SECONDS:
            self._arrivals.popleft()
        if not self._arrivals:
            return 0
        each = sum(tokens for _, tokens in self._arrivals) / len(self._arrivals)
        coming = math.ceil(len(self._arrivals) / RECENT_SECONDS * ahead_seconds)
        return int(each * (self.in_flight + coming))

    def first_token(self, seconds: float) -> None:
        self._first_tokens.append((self._now(), seconds))

    def done(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)  # a report without its arrival must not leave the count negative

    def quiet_for(self, now: float) -> float:
        return now - self.last_arrival

    def first_token_percentile(self, arrived_since: float) -> float | None:
        """The `PERCENTILE` time to first token of the requests that arrived since then (None: none measured)."""
        while self._first_tokens and self._first_tokens[0][0] < self._now() - RECENT_SECONDS:
            self._first_tokens.popleft()
        seconds = sorted(ttft for came, ttft in self._first_tokens if came - ttft >= arrived_since)
        if not seconds:
            return None
        return seconds[min(len(seconds) - 1, math.ceil(PERCENTILE * len(seconds)) - 1)]


class InFlightWindow:
    """Places for batch lines (`execution.Slots`), as many as a size that moves between `least` and `max_size`;
    `ttft_target_seconds` 0 keeps it at `max_size` and withdraws nothing. Used on the engine loop only; `size` and
    `withdrawn` may be read from any thread."""

    def __init__(
        self,
        *,
        max_size: int,
        wave: int,
        ttft_target_seconds: float,
        now: Callable[[], float] | None = None,
        pacer: PrefillPacer | None = None,
    ) -> None:
        now = now or (lambda: clock.monotonic())  # looked up at each call: a test may drive `clock.monotonic`
        self.pacer = pacer
        if pacer is not None:
            pacer.live_reserve = lambda: self.online.kv_reserve(TICK_SECONDS)
        self.max_size = max_size
        self.size = max_size
        self.wave = wave
        self.ttft_target_seconds = ttft_target_seconds
        self.held = 0  # batch lines in flight now: above `size` for a while after a shrink
        self.withdrawn = 0  # batch lines withdrawn for online requests, since the engine started
        self.online = OnlineTraffic(now)
        self._now = now
        self._shrunk_at = -math.inf
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._places: dict[Place, None] = {}  # in the order they were taken: the youngest last
        self._leaving = 0  # withdrawn places not yet given back

    @property
    def numbers(self) -> WindowSize:
        return WindowSize(self.size, self.max_size)

    @property
    def least(self) -> int:
        return min(self.max_size, max(1, self.wave // 8))

    @property
    def ceiling(self) -> int:
        """The most while online traffic is about: a wave less room for it, and no more than `decode_bound`."""
        room = max(self.grow_step, 2 * self.online.in_flight)
        return min(self.max_size, max(self.least, min(self.wave - room, self.decode_bound)))

    @property
    def decode_bound(self) -> int:
        """The most batch lines whose decode fits in the batch's part of a step (module docstring); a wave while the
        engine's decode cost is not known."""
        costs = self.pacer.steps.costs() if self.pacer is not None else None
        if costs is None or not costs.per_decode:
            return self.wave
        return int(self.ttft_target_seconds * LIVE_STEP_SHARE / costs.per_decode)

    @property
    def grow_step(self) -> int:
        return max(1, self.wave // 16)

    # The online path's reports, on the engine loop.

    def online_arrived(self, body: dict | None = None) -> None:
        """`body`: what the engine is given (None: not known), whose prompt and output the KV cache keeps room for
        and whose prompt tokens the engine's steps count as live."""
        prompt = 0 if body is None else estimated_tokens(body)
        self.online.arrived(prompt + _most_output(body))
        if self.pacer is not None:
            self.pacer.steps.online_arrived(prompt)
        if self.ttft_target_seconds > 0:
            if self.pacer is not None:
                self.pacer.activate(True)
            self.resize(min(self.size, self.ceiling))
            staying = self.held - self._leaving
            beyond = max(staying + self.online.in_flight - self.wave, staying - self.decode_bound)
            self._withdraw(min(beyond, staying - self.least))

    def online_first_token(self, seconds: float) -> None:
        self.online.first_token(seconds)

    def online_done(self) -> None:
        self.online.done()

    # The places.

    @asynccontextmanager
    async def place(self) -> AsyncIterator[Place]:
        await self.acquire()
        place = Place()
        self._places[place] = None
        try:
            yield place
        finally:
            del self._places[place]
            if place.withdrawn:
                self._leaving -= 1
            self.release()

    def _withdraw(self, count: int) -> None:
        for place in reversed(list(self._places)) if count > 0 else ():
            if count == 0:
                return
            if not place.withdrawn and place.withdraw():
                self._leaving += 1
                self.withdrawn += 1
                count -= 1

    async def acquire(self) -> None:
        if self.held < self.size and not self._waiters:
            self.held += 1
            return
        place = asyncio.get_running_loop().create_future()
        self._waiters.append(place)
        try:
            await place
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():  # given a place as it was cancelled: it goes to the next
                self.release()
            else:
                self._waiters.remove(place)
            raise

    def release(self) -> None:
        self.held -= 1
        self._let_in()

    def resize(self, size: int) -> None:
        self.size = size
        self._let_in()

    def _let_in(self) -> None:
        while self._waiters and self.held < self.size:
            place = self._waiters.popleft()
            if not place.done():
                self.held += 1
                place.set_result(None)

    # The controller.

    def tick(self) -> int:
        """Set the size by the rule (module docstring), and tell the pacing whether live traffic is about; returns
        the size."""
        quiet = self._quiet()
        if quiet:
            self.resize(self.max_size)
        else:
            self.resize(max(self.least, min(self.ceiling, self._wanted())))
        if self.pacer is not None:
            self.pacer.activate(not quiet)
        return self.size

    def _quiet(self) -> bool:
        if self.ttft_target_seconds <= 0:
            return True
        return self.online.in_flight == 0 and self.online.quiet_for(self._now()) >= QUIET_SECONDS

    def _wanted(self) -> int:
        now = self._now()
        first_token = self.online.first_token_percentile(arrived_since=self._shrunk_at)
        if first_token is not None and first_token > self.ttft_target_seconds:
            self._shrunk_at = now
            return int(self.size * SHRINK)
        if first_token is not None or self.online.quiet_for(now) >= QUIET_SECONDS:
            return self.size + self.grow_step
        return self.size

    @asynccontextmanager
    async def adapting(self) -> AsyncIterator[None]:
        """Ticks every `TICK_SECONDS` while the context is open (the engine loop's scheduling)."""

        async def ticks() -> None:
            while True:
                await asyncio.sleep(TICK_SECONDS)
                self.tick()

        ticking = asyncio.create_task(ticks())
        try:
            yield
        finally:
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)


def _most_output(body: dict | None) -> int:
    """The most tokens an online request may generate, as far as its body says."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = (body or {}).get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_LIVE_OUTPUT
