"""Runs a stream of batch lines through an executor with a bounded number in flight.

A fixed set of worker coroutines pulls lines from one iterator, so memory follows what is in flight, not the
size of the file. Each line holds a `Place` while it runs; the batch window (`app.engine.window`) may withdraw a
line from its place to seat an online request: its request is aborted in the engine, and the line runs again once
it has a place again, so it still gets exactly one outcome. A `Gate` may hold the next line back until lines in
flight make room for it (LoRA adapters, `app.engine.ordering`); lines wait there without a place. A `Pacer` holds a
line with its place until its prompt tokens fit the engine's next step (`app.engine.pacing`); one withdrawn while
it waits there has cost nothing.
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
    """Places for lines in flight: `FixedSlots`, or the batch window (`app.engine.window`), whose size moves."""

    def place(self) -> AbstractAsyncContextManager[Place]: ...


class Gate(Protocol):
    """Holds lines back while the engine should not take them yet, in the order they come
    (`app.engine.ordering.AdapterGate`)."""

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
    """Lets lines into the engine at a pace of prompt tokens (`app.engine.pacing.PrefillPacer`)."""

    def estimate(self, body: dict) -> int:
        """The body's prompt tokens, as the pace counts them."""
        ...

    def paces(self, *, ramp: bool = False) -> bool:
        """Whether a line must go through `admit` now (False: it enters at once)."""
        ...

    async def admit(self, tokens: int, *, ramp: bool = False) -> None:
        """Returns once a line of `tokens` may enter the engine; `ramp`: one of a new batch's first wave."""
        ...

    def answered(self, estimated: int, usage: dict | None) -> None:
        """The line has its answer, with the engine's usage."""
        ...


class _Held:
    """What the next line is when the gate holds it back."""


HELD = _Held()


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
    """Returns when every line has an outcome. Cancelling it aborts the requests in flight (they write nothing).
    `engine_body`: what the engine is given for a line's body (None: the body as it is). `gate`: lines wait there
    in order, before taking a place: one that waits with a place would keep it from a withdrawn line it waits for.
    `pacer`: each line waits there with its place before it is sent, the first `ramp` lines as a new batch's first
    wave.

    An exception from the executor (the engine died) cancels the other workers and propagates; `in_flight` then
    holds the numbers of the lines that had been sent and have no outcome.
    """
    sent: set[int] = set() if in_flight is None else in_flight
    source = _Source(lines, gate, on_all_submitted)
    sender = _Sender(executor, endpoint, engine_body, pacer)

    async def worker() -> None:
        line: Line | None = None
        first_wave = False
        while True:
            if gate is not None and line is None:
                await gate.opened()
            async with slots.place() as place:
                if line is None:
                    pulled = await source.next()
                    if pulled is None:
                        return
                    if isinstance(pulled, _Held):
                        continue  # its place given back: the gate is waited on without one
                    line, first_wave = pulled, source.pulled <= ramp
                    sent.add(line[0])
                outcome = await sender.send(place, line, first_wave)
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


class _Source:
    """The lines in their order, to one puller at a time (one async generator); the gate may hold the next back."""

    def __init__(
        self, lines: AsyncIterator[Line], gate: Gate | None, on_all_submitted: Callable[[], None] | None
    ) -> None:
        self._lines = lines
        self._gate = gate
        self._on_all_submitted = on_all_submitted
        self._exhausted = False
        self._held: Line | None = None
        self._pulling = asyncio.Lock()
        self.pulled = 0  # lines handed to the workers so far

    async def next(self) -> Line | _Held | None:
        async with self._pulling:
            if self._exhausted:
                return None
            line, self._held = self._held or await anext(self._lines, None), None
            if line is None:
                self._exhausted = True
                if self._on_all_submitted is not None:
                    self._on_all_submitted()
            elif self._gate is not None and not self._gate.admit(line[0]):
                self._held = line
                return HELD
            else:
                self.pulled += 1
            return line


class _Sender:
    """A line's request to the engine, from its place: paced, sent, answered."""

    def __init__(
        self, executor: Executor, endpoint: str, engine_body: Callable[[dict], dict] | None, pacer: Pacer | None
    ) -> None:
        self._executor = executor
        self._endpoint = endpoint
        self._engine_body = engine_body
        self._pacer = pacer

    async def send(self, place: Place, line: Line, first_wave: bool) -> Outcome | None:
        """The line's outcome; None when its place withdrew it (while it waited for the pace, or in the engine)."""
        _, request, rank = line
        body = request["body"] if self._engine_body is None else self._engine_body(request["body"])
        pacer = self._pacer
        estimated = 0 if pacer is None else pacer.estimate(body)
        waits = pacer is not None and pacer.paces(ramp=first_wave)
        if waits and await _run_in(place, _paced(pacer, estimated, first_wave)) is None:
            return None
        answer = await _run_in(place, self._executor.execute(self._endpoint, body, rank))
        if answer is None:
            return None
        outcome = http_outcome(request["custom_id"], *answer)
        if pacer is not None:
            pacer.answered(estimated, outcome.usage)
        return outcome


async def _paced(pacer: Pacer | None, tokens: int, first_wave: bool) -> bool:
    if pacer is not None:
        await pacer.admit(tokens, ramp=first_wave)
    return True


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
