"""The lease holder: which batches this service holds (`app.domain.leases`), kept in the registry it shares with
the scheduler and the watchdog (`app.engine.batch.runs`).

At every look for work it renews the leases it holds (once a third of a lease has passed since it last did) and
stops the runs of those it lost, claims batches no one holds (up to `hold_at_most`), and ends the leases of batches
that have ended. A service that stops gives its batches up, for the next one to take at once. Each database call
runs on a thread, and what it returns is applied on the loop: the registry is the loop's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection

from sqlalchemy.engine import Engine

from app.core.config import Settings
from app.domain import batches, leases
from app.domain.leases import Lease
from app.domain.models import BatchRow
from app.engine.batch.runs import Runs
from app.engine.inference.found_adapters import ClaimableAdapters

log = logging.getLogger("vbatch.engine")
# Leases are renewed this many times in a lease's length: one renewal may fail (the database away for a moment)
# and the next still comes in time.
RENEWALS_PER_LEASE = 3
# A look reads the rows of the batches it holds again only when they may have changed under it (a claim, a run that
# ended) or after this long (the watchdog's clock); between, a run reads its own batch, and a batch waiting for its
# turn its own, when that matters.
REREAD_SECONDS = 10.0


class LeaseHolder:
    def __init__(
        self, runs: Runs, serves: Callable[[], Collection[str]], adapters: ClaimableAdapters | None = None
    ) -> None:
        """`serves`: the models (and adapters) this service's engine serves, now; `adapters`: those of
        `VBATCH_LORA_DIR` it could load."""
        self.runs = runs
        self.name = leases.holder_name()
        self.serves = serves
        self.adapters = adapters
        # At most this many batches at once (None: every active batch, as `vbatch serve` alone does).
        self.hold_at_most: int | None = None
        self._renewed_at = -float("inf")  # time.monotonic() of the last renewal
        self._rows: dict[str, BatchRow] = {}  # the active batches it held at the last read, oldest first
        self._read: set[str] = set()  # the batches it held then
        self._read_at = -float("inf")
        self._runs_ended = 0  # `Runs.ended` then

    async def _models(self, db: Engine) -> Collection[str] | None:
        """The models of the batches it claims: beside other workers, those it serves (`leases.claim`) and the
        adapters of `VBATCH_LORA_DIR` it could load that unheld batches name; alone (`vbatch serve`), any, as no
        other service could take a batch for another model, which fails validation at once."""
        if self.hold_at_most is None:
            return None
        served = list(self.serves())
        if self.adapters is None or not self.adapters.looks_up:
            return served
        named = [model for model in await asyncio.to_thread(leases.unheld_models, db=db) if model not in served]
        return served + (await asyncio.to_thread(self.adapters.among, named) if named else [])

    async def release_dead(self, db: Engine) -> None:
        with contextlib.suppress(Exception):  # an unreadable database is reported by the first look for work
            if freed := await asyncio.to_thread(leases.release_dead, db=db):
                log.info("freed the leases of %d holders on this host whose processes are gone", freed)

    async def hold(self, db: Engine, settings: Settings) -> list[BatchRow]:
        """Renew this service's leases, stop the runs of those it lost, claim the batches no one holds, and end the
        leases of those that have ended: the active batches it now holds, oldest first."""
        await self._renew(db, settings)
        room = None if self.hold_at_most is None else self.hold_at_most - len(self.runs)
        if room is None or room > 0:
            await self._claim(db, settings, room)
        rows = await self._held_rows(db)
        active = {row.id for row in rows}
        for batch_id in [b for b in self.runs.ids() if b not in active and not self.runs.running(b)]:
            lease = self.runs.lease(batch_id)
            assert lease is not None
            # Its end written to the row before it leaves the registry: a write that fails is tried at the next look.
            await asyncio.to_thread(leases.end, db=db, lease=lease)
            self.runs.drop(batch_id)
        return rows

    async def _held_rows(self, db: Engine) -> list[BatchRow]:
        """The active batches it holds, oldest first: read again after a claim or a run's end, and every
        `REREAD_SECONDS`; else as last read."""
        held = self.runs.ids()
        now = time.monotonic()
        if now - self._read_at >= REREAD_SECONDS or self._runs_ended != self.runs.ended or not self._read >= set(held):
            ended = self.runs.ended  # before the read: a run that ends during it is read again next time
            rows = await asyncio.to_thread(batches.active_among, db=db, batch_ids=held)
            self._rows = {row.id: row for row in rows}
            self._read, self._read_at, self._runs_ended = set(held), now, ended
        return [row for batch_id, row in self._rows.items() if batch_id in self.runs]

    def has_room(self) -> bool:
        return self.hold_at_most is None or len(self.runs) < self.hold_at_most

    async def _renew(self, db: Engine, settings: Settings) -> None:
        """Every lease in one write, once a third of a lease has passed since the last; stops the runs of those lost."""
        now = time.monotonic()
        if now - self._renewed_at < settings.lease_seconds / RENEWALS_PER_LEASE:
            return
        lost = await asyncio.to_thread(leases.renew, db=db, leases=self.runs.leases(), seconds=settings.lease_seconds)
        self._renewed_at = now
        for batch_id in lost:
            if self.runs.running(batch_id):
                log.error("batch %s: its lease passed to another service; this run stops", batch_id)
            await self.runs.let_go(batch_id)

    async def _claim(self, db: Engine, settings: Settings, room: int | None) -> None:
        """Hold what the claim took even when a stop cancels the wait for it: a lease taken without this service
        knowing would not be released at the stop, and would keep its batch from every other one until it ran out."""
        models = await self._models(db)
        claiming = asyncio.ensure_future(
            asyncio.to_thread(
                leases.claim, db=db, holder=self.name, seconds=settings.lease_seconds, limit=room, models=models
            )
        )
        try:
            claimed = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            self._keep(await claiming)
            raise
        self._keep(claimed)

    def _keep(self, claimed: list[Lease]) -> None:
        for lease in claimed:
            self.runs.hold(lease)
            if lease.token > 1:
                log.info(
                    "batch %s: held again (lease token %d); it goes on from its last checkpoint",
                    lease.batch_id,
                    lease.token,
                )

    async def release_all(self, db: Engine) -> None:
        """A service that stops gives its batches up, for the next one to take at once (its runs have stopped)."""
        await asyncio.to_thread(_release, db, self.runs.leases())
        self.runs.clear()


def _release(db: Engine, held: list[Lease]) -> None:
    for lease in held:
        try:
            leases.release(db=db, lease=lease)
        except Exception:
            log.warning("batch %s: its lease could not be released; it passes on when it runs out", lease.batch_id)
