"""Whose batch feeds the engine next.

One batch at a time hands its lines to the engine (the next one starts as soon as the last line of the current
one is sent, so they share the engine at the tail). Turns go round robin over API keys, and within a key in
creation order: one key's hundred queued batches no longer delay every other key's, and after a restart the
resumed batches keep their places (creation order is in the database, not in the order tasks were made).

A batch waiting for its turn costs nothing: it wakes when the service says something changed (a batch created
or cancelled) or when its completion window closes, not on a timer.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

Ended = TypeVar("Ended")


@dataclass(order=True)
class _Waiter:
    created_ns: int
    batch_id: str
    granted: asyncio.Future = field(compare=False)


class Turn:
    """The right to feed the engine; `release` (idempotent) passes it on."""

    def __init__(self, feed: FairFeed, owner: str) -> None:
        self._feed = feed
        self.owner = owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._feed._release()


class FairFeed:
    def __init__(self) -> None:
        self._waiting: dict[str, list[_Waiter]] = {}  # owner -> heap by creation time
        self._busy = False
        self._last_owner: str | None = None

    async def turn(self, *, owner: str, created_ns: int, batch_id: str) -> Turn:
        waiter = _Waiter(created_ns, batch_id, asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting.setdefault(owner, []), waiter)
        self._grant()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release()  # granted just as it was cancelled: pass the turn on
            else:
                self._forget(owner, waiter)
            raise
        return Turn(self, owner)

    async def turn_or_end(
        self,
        *,
        owner: str,
        created_ns: int,
        batch_id: str,
        changes: Changes,
        deadline: float | None,
        ending: Callable[[], Awaitable[Ended | None]],
    ) -> Turn | Ended:
        """The turn; or what `ending` says the batch ends with, asked after each change (a batch created or
        cancelled) and at `deadline` (unix seconds): a batch cancelled or expired while it waits ends without a turn.
        A turn granted while it ends is passed on, never kept: a turn kept by a batch that has ended would leave
        every later batch of this service waiting for good."""
        turn = asyncio.ensure_future(self.turn(owner=owner, created_ns=created_ns, batch_id=batch_id))
        kept = False
        try:
            changed = changes.watch()
            while True:
                left = None if deadline is None else max(0.0, deadline - time.time())
                heard = asyncio.ensure_future(changed.wait())
                await asyncio.wait([turn, heard], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                heard.cancel()
                if turn.done():
                    kept = True
                    return turn.result()
                changed = changes.watch()  # before `ending` looks: a change while it looks is not missed
                if (ended := await ending()) is not None:
                    return ended
        finally:
            if not turn.done():
                turn.cancel()
                await asyncio.gather(turn, return_exceptions=True)
            elif not kept and not turn.cancelled() and turn.exception() is None:
                turn.result().release()

    def waiting(self) -> int:
        # list() copies the values in one step, so another thread may call this while the loop changes the dict.
        return sum(len(queue) for queue in list(self._waiting.values()))

    def _release(self) -> None:
        self._busy = False
        self._grant()

    def _forget(self, owner: str, waiter: _Waiter) -> None:
        queue = self._waiting.get(owner, [])
        if waiter in queue:
            queue.remove(waiter)
            heapq.heapify(queue)
        if not queue:
            self._waiting.pop(owner, None)

    def _grant(self) -> None:
        while not self._busy and self._waiting:
            owner = self._next_owner()
            waiter = heapq.heappop(self._waiting[owner])
            if not self._waiting[owner]:
                del self._waiting[owner]
            if waiter.granted.done():  # its task was cancelled and has not yet run to forget it
                continue
            self._busy = True
            self._last_owner = owner
            waiter.granted.set_result(None)

    def _next_owner(self) -> str:
        """The first owner after the last one served, in a fixed (sorted) order of the owners now waiting."""
        owners = sorted(self._waiting)
        if self._last_owner is None:
            return min(owners, key=lambda owner: self._waiting[owner][0].created_ns)
        later = [owner for owner in owners if owner > self._last_owner]
        return later[0] if later else owners[0]


class Changes:
    """A broadcast: `wait` returns at the next `notify` after it was called; the event `watch` gives is set by the
    next `notify` after `watch`, however long after it is waited on."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def watch(self) -> asyncio.Event:
        return self._event

    async def wait(self) -> None:
        await self._event.wait()
