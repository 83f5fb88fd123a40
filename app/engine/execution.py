"""Runs a stream of batch lines through an executor with a bounded number in flight.

A fixed set of worker coroutines pulls lines from one iterator, so memory follows what is in flight, not the
size of the file. Each line holds a `Place` while it runs; the batch window (`app.engine.window`) may withdraw a
line from its place to seat an online request: its request is aborted in the engine, and the line runs again once
it has a place again, so it still gets exactly one outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

from app.domain.results import Body, Outcome, http_outcome


class Executor(Protocol):
    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]: ...


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


class FixedSlots:
    """As many places as `size`; none is ever withdrawn."""

    def __init__(self, size: int) -> None:
        self._free = asyncio.Semaphore(size)

    @asynccontextmanager
    async def place(self) -> AsyncIterator[Place]:
        async with self._free:
            yield Place()


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
) -> None:
    """Returns when every line has an outcome. Cancelling it aborts the requests in flight (they write nothing).
    `engine_body`: what the engine is given for a line's body (None: the body as it is).

    An exception from the executor (the engine died) cancels the other workers and propagates; `in_flight` then
    holds the numbers of the lines that had been sent and have no outcome.
    """
    sent: set[int] = set() if in_flight is None else in_flight
    exhausted = False
    pulling = asyncio.Lock()  # one async generator: one puller at a time

    async def next_line() -> Line | None:
        nonlocal exhausted
        async with pulling:
            if exhausted:
                return None
            line = await anext(lines, None)
            if line is None:
                exhausted = True
                if on_all_submitted is not None:
                    on_all_submitted()
            return line

    async def worker() -> None:
        line: Line | None = None
        while True:
            async with slots.place() as place:
                if line is None:
                    line = await next_line()
                    if line is None:
                        return
                    sent.add(line[0])
                number, request, rank = line
                body = request["body"] if engine_body is None else engine_body(request["body"])
                answer = await _run_in(place, executor.execute(endpoint, body, rank))
                if answer is None:
                    continue  # withdrawn: the same line again, at its next place
                sent.discard(number)
                on_outcome(number, http_outcome(request["custom_id"], *answer))
                line = None

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, workers))]
    try:
        await _gather_or_cancel(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_in(place: Place, request: Coroutine[Any, Any, tuple[int, Body]]) -> tuple[int, Body] | None:
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
