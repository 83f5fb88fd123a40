"""Runs a stream of batch lines through an executor with a bounded number in flight.

A fixed set of worker coroutines pulls lines from one iterator, so memory follows what is in flight, not the
size of the file. Each line holds a `Place` while it runs; the batch window (`app.engine.sharing.window`) may withdraw a
line from its place to seat an online request: its request is aborted in the engine, and the line runs again once
it has a place again, so it still gets exactly one outcome. A `Gate` may hold the next line back until lines in
flight make room for it (LoRA adapters, `app.engine.batch.ordering`), and a `Pacer` until its prompt tokens fit the
engine's next step (`app.engine.sharing.pacing`); lines wait there without a place, in their order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeVar

from app.domain.results import Body, Outcome, http_outcome


class Executor(Protocol):
    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]: ...


class TimedExecutor:
    """An executor that tells `on_left(seconds, answered)` of each request once it leaves the engine: its seconds
    in flight, and whether it was answered (whatever its status) or not (withdrawn, cancelled, its engine dead).
    A request aborted by cancelling its task counts as unanswered though vLLM's handler turns the abort into a
    "client disconnected" answer."""

    def __init__(self, executor: Executor, on_left: Callable[[float, bool], None]) -> None:
        self._executor = executor
        self._on_left = on_left

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        started = time.monotonic()
        answered = False
        try:
            answer = await self._executor.execute(endpoint, body, rank)
            answered = not _being_cancelled()
            return answer
        finally:
            self._on_left(time.monotonic() - started, answered)


class Place:
    """A line's place in flight, and the engine request it runs there while it runs one."""

    __slots__ = ("request", "withdrawn")

    def __init__(self) -> None:
        self.request: asyncio.Future | None = None
        self.withdrawn = False

    def withdraw(self) -> bool:
        """Aborts the request running here (False: none is, or it has its answer); its line runs again."""
        if self.request is None or self.request.done():
            return False
        self.request.cancel()
        self.withdrawn = True
        return True


class Slots(Protocol):
    """Places for lines in flight: `FixedSlots`, or the batch window (`app.engine.sharing.window`), whose size moves."""

    def place(self) -> AbstractAsyncContextManager[Place]: ...


class Gate(Protocol):
    """Holds lines back while the engine should not take them yet, in the order they come
    (`app.engine.batch.ordering.AdapterGate`)."""

    async def opened(self) -> None:
        """Returns once a line held back may be let in (at once when none is)."""
        ...

    def admit(self, position: int) -> bool:
        """Lets the line in; or False, and `opened` waits until lines let in before have made room for it."""
        ...

    def leave(self, position: int) -> None:
        """The line let in has its outcome."""
        ...


class Pacer(Protocol):
    """Lets lines into the engine at a pace of prompt tokens (`app.engine.sharing.pacing.PrefillPacer`), in their
    order."""

    def estimate(self, body: dict) -> int:
        """The body's prompt tokens, as the pace counts them."""
        ...

    def fits(self, tokens: int, *, ramp: bool = False) -> bool:
        """Whether a line of `tokens` may enter now; `ramp`: one of a new batch's first wave."""
        ...

    def take(self, tokens: int, *, ramp: bool = False) -> None:
        """The line that fits enters."""
        ...

    async def opened(self) -> None:
        """Returns when a line that did not fit may try again."""
        ...

    def answered(self, body: dict, usage: dict | None) -> None:
        """A line has its answer, with the engine's usage."""
        ...


class _HeldBack:
    """What the next line is when the gate holds it back."""


HELD = _HeldBack()
PACED = _HeldBack()  # the next line is held back by the pace of prompt tokens, not the gate


class FixedSlots:
    """As many places as `size`; none is ever withdrawn."""

    def __init__(self, size: int) -> None:
        self._free = asyncio.Semaphore(size)

    @asynccontextmanager
    async def place(self) -> AsyncIterator[Place]:
        async with self._free:
            yield Place()


T = TypeVar("T")
# (position, request, data-parallel rank or None)
Line = tuple[int, dict, int | None]
OnOutcome = Callable[[int, Outcome], None]


async def run_lines(
    lines: AsyncIterator[Line],
    *,
    executor: Executor,
    endpoint: str,
    slots: Slots,
    workers: int,
    on_outcome: OnOutcome,
    on_all_submitted: Callable[[], None] | None = None,
    in_flight: set[int] | None = None,
    engine_body: Callable[[dict], dict] | None = None,
    gate: Gate | None = None,
    pacer: Pacer | None = None,
    ramp: int = 0,
) -> None:
    """Returns when every line has an outcome; cancelling it aborts the requests in flight (they write nothing).
    `engine_body`: what the engine is given for a body (None: the body). `gate` and `pacer` (the first `ramp` lines
    a first wave): lines wait there in order without a place, which a withdrawn line they wait for may need. An
    executor's exception (the engine died) cancels the other workers and propagates; `in_flight` then holds the
    numbers of the lines sent with no outcome."""
    sent: set[int] = set() if in_flight is None else in_flight
    source = _Source(lines, gate, on_all_submitted, pacer, ramp)
    sender = _Sender(executor, endpoint, engine_body, pacer)

    async def worker() -> None:
        line: Line | None = None
        waiting: _HeldBack | None = None  # what the last try found in the way
        while True:
            await _opened(waiting or (HELD if line is None else None), gate, pacer)
            async with slots.place() as place:
                if line is None:
                    pulled = await source.next()
                    if pulled is None:
                        return
                    if isinstance(pulled, _HeldBack):
                        waiting = pulled
                        continue  # its place given back: the gate or the pace is waited on without one
                    line = pulled
                    sent.add(line[0])
                elif not source.again(line):
                    waiting = PACED
                    continue
                waiting = None
                outcome = await sender.send(place, line)
                if outcome is None:
                    continue  # withdrawn: the same line again, at its next place
                sent.discard(line[0])
                on_outcome(line[0], outcome)
                if gate is not None:
                    gate.leave(line[0])
                line = None

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, workers))]
    try:
        await _gather_or_cancel(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _opened(waiting: _HeldBack | None, gate: Gate | None, pacer: Pacer | None) -> None:
    """Waits, without a place, for what held the last line back: the gate (before a new line, always), the pace."""
    if waiting is PACED and pacer is not None:
        await pacer.opened()
    elif waiting is HELD and gate is not None:
        await gate.opened()


class _Source:
    """The lines in their order, to one puller at a time (one async generator); the pace or the gate may hold the
    next back, and the lines after it wait behind it."""

    def __init__(
        self,
        lines: AsyncIterator[Line],
        gate: Gate | None,
        on_all_submitted: Callable[[], None] | None,
        pacer: Pacer | None = None,
        ramp: int = 0,
    ) -> None:
        self._lines = lines
        self._gate = gate
        self._on_all_submitted = on_all_submitted
        self._pacer = pacer
        self._ramp = ramp
        self._exhausted = False
        self._held: Line | None = None
        self._pulling = asyncio.Lock()
        self.pulled = 0  # lines handed to the workers so far

    async def next(self) -> Line | _HeldBack | None:
        async with self._pulling:
            if self._exhausted:
                return None
            line, self._held = self._held or await anext(self._lines, None), None
            if line is None:
                self._exhausted = True
                if self._on_all_submitted is not None:
                    self._on_all_submitted()
                return None
            first_wave = self.pulled < self._ramp
            tokens = 0 if self._pacer is None else self._pacer.estimate(line[1]["body"])
            if self._pacer is not None and not self._pacer.fits(tokens, ramp=first_wave):
                self._held = line
                return PACED
            if self._gate is not None and not self._gate.admit(line[0]):
                self._held = line
                return HELD
            if self._pacer is not None:
                self._pacer.take(tokens, ramp=first_wave)
            self.pulled += 1
            return line

    def again(self, line: Line) -> bool:
        """A withdrawn line's next run: whether the pace lets it in now (taking its tokens if so)."""
        if self._pacer is None:
            return True
        tokens = self._pacer.estimate(line[1]["body"])
        if not self._pacer.fits(tokens):
            return False
        self._pacer.take(tokens)
        return True


class _Sender:
    """A line's request to the engine, from its place: sent, answered."""

    def __init__(
        self, executor: Executor, endpoint: str, engine_body: Callable[[dict], dict] | None, pacer: Pacer | None
    ) -> None:
        self._executor = executor
        self._endpoint = endpoint
        self._engine_body = engine_body
        self._pacer = pacer

    async def send(self, place: Place, line: Line) -> Outcome | None:
        """The line's outcome; None when its place withdrew it."""
        _, request, rank = line
        body = request["body"] if self._engine_body is None else self._engine_body(request["body"])
        answer = await _run_in(place, self._executor.execute(self._endpoint, body, rank))
        if answer is None:
            return None
        outcome = http_outcome(request["custom_id"], *answer)
        if self._pacer is not None:
            self._pacer.answered(request["body"], outcome.usage)
        return outcome


async def _run_in(place: Place, request: Coroutine[Any, Any, T]) -> T | None:
    """The request's answer; None when the place withdrew it."""
    place.request = asyncio.ensure_future(request)
    try:
        answer = await place.request
    except asyncio.CancelledError:
        if place.withdrawn and not _being_cancelled():
            return None
        raise
    finally:
        place.request = None
    if _being_cancelled():
        # vLLM's handlers turn an abort into a "client disconnected" error body; that request did not finish, so it
        # gets no line here (cancel and expiry write theirs).
        raise asyncio.CancelledError
    return None if place.withdrawn else answer


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _gather_or_cancel(tasks: list[asyncio.Task]) -> None:
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    if pending:
        await asyncio.gather(*pending)
