"""Runs a stream of batch lines through an executor with a bounded number in flight.

A fixed set of worker coroutines pulls lines from one iterator, so memory follows what is in flight, not the
size of the file, and no task is built per line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Protocol

from app.domain.results import Body, Outcome, http_outcome


class Executor(Protocol):
    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]: ...


class Slots(Protocol):
    """Places for lines in flight: `asyncio.Semaphore`, or the batch window (`app.engine.window`), whose size moves."""

    async def __aenter__(self) -> None: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


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
        while True:
            async with slots:
                line = await next_line()
                if line is None:
                    return
                number, request, rank = line
                sent.add(number)
                body = request["body"] if engine_body is None else engine_body(request["body"])
                status, body = await executor.execute(endpoint, body, rank)
                if _being_cancelled():
                    # vLLM's handlers turn an abort into a "client disconnected" error body; that request did
                    # not finish, so it gets no line here (cancel and expiry write theirs).
                    raise asyncio.CancelledError
                sent.discard(number)
                on_outcome(number, http_outcome(request["custom_id"], status, body))

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, workers))]
    try:
        await _gather_or_cancel(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
