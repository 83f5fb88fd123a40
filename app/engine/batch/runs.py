"""The batches this service holds, in the one registry its lease holder, scheduler and watchdog share: each batch's
lease, its run's task while one runs, and that run's live numbers once it has begun; and the batches whose run
broke.

Written on the engine loop only. The API reads the leases and the live numbers from its own thread (`leases_by_id`,
`stats`, `rates`): each read takes a snapshot, never a view that the loop changes under it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from app.domain.leases import Lease
from app.domain.schemas import RunStats


class RunningBatch(Protocol):
    """What the registry reads of a run: its live numbers (`app.engine.batch.runner.BatchRun`)."""

    def stats(self) -> RunStats | None: ...


@dataclass
class Held:
    lease: Lease
    task: asyncio.Task[None] | None = None
    live: RunningBatch | None = None


class Runs:
    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        # Batches whose run raised something unexpected: not run again in a loop, picked up again at the next start.
        self._broken: set[str] = set()
        self.ended = 0  # runs ended so far: the lease holder reads its batches again after one has

    # The leases.

    def hold(self, lease: Lease) -> None:
        held = self._held.get(lease.batch_id)
        if held is None:
            self._held[lease.batch_id] = Held(lease)
        else:
            held.lease = lease

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def ids(self) -> list[str]:
        return list(self._held)

    def lease(self, batch_id: str) -> Lease | None:
        held = self._held.get(batch_id)
        return held.lease if held is not None else None

    def leases(self) -> list[Lease]:
        return [held.lease for held in self._held.values()]

    def leases_by_id(self) -> dict[str, Lease]:
        """From any thread."""
        return {batch_id: held.lease for batch_id, held in list(self._held.items())}

    async def let_go(self, batch_id: str) -> None:
        """Its lease has passed on: its run stops (its live numbers go with it), then it leaves the registry."""
        await self.stop(batch_id)
        self._held.pop(batch_id, None)

    def drop(self, batch_id: str) -> None:
        """Its lease is ended or released: it leaves the registry."""
        self._held.pop(batch_id, None)

    def clear(self) -> None:
        self._held.clear()

    # The runs.

    def runnable(self, batch_id: str) -> bool:
        """Held, with no run going and none that broke."""
        held = self._held.get(batch_id)
        return held is not None and held.task is None and batch_id not in self._broken

    def start(self, batch_id: str, task: asyncio.Task[None]) -> None:
        self._held[batch_id].task = task

    def running(self, batch_id: str) -> bool:
        held = self._held.get(batch_id)
        return held is not None and held.task is not None

    def any_running(self) -> bool:
        return any(held.task is not None for held in self._held.values())

    def tasks(self) -> list[asyncio.Task[None]]:
        return [held.task for held in self._held.values() if held.task is not None]

    def finished(self, batch_id: str, *, broke: bool = False) -> None:
        """Called by the run's task as it ends."""
        self.ended += 1
        held = self._held.get(batch_id)
        if held is not None and held.task is asyncio.current_task():
            held.task = None
        if broke:
            self._broken.add(batch_id)

    async def stop(self, batch_id: str) -> bool:
        """Stop its run, if one goes, and forget that one broke; whether a run was stopped."""
        self._broken.discard(batch_id)
        held = self._held.get(batch_id)
        task = held.task if held is not None else None
        if held is None or task is None:
            return False
        held.task = None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    # The live numbers.

    def show(self, batch_id: str, live: RunningBatch) -> None:
        held = self._held.get(batch_id)
        if held is not None:
            held.live = live

    def hide(self, batch_id: str, live: RunningBatch) -> None:
        held = self._held.get(batch_id)
        if held is not None and held.live is live:
            held.live = None

    def stats(self, batch_id: str) -> RunStats | None:
        """A running batch's live numbers, from any thread; None when it is not running here."""
        held = self._held.get(batch_id)
        live = held.live if held is not None else None
        return live.stats() if live is not None else None

    def rates(self) -> dict[str, tuple[float, float]]:
        """Each running batch's (requests/s, output tokens/s), from any thread."""
        rates = {}
        for batch_id, held in list(self._held.items()):
            live = held.live
            stats = live.stats() if live is not None else None
            if stats is not None:
                rates[batch_id] = (stats.requests_per_second or 0.0, stats.output_tokens_per_second or 0.0)
        return rates
