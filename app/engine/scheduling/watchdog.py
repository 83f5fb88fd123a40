"""The watchdog: every batch still active `watchdog_grace_seconds` after its completion window ends, its run (one
that hangs on) stopped first. Which batches are overdue, and how one ends, `app.engine.batch.ending` decides; this keeps
the batches it could not end at all, to try again quietly."""

from __future__ import annotations

import logging

from sqlalchemy.engine import Engine

from app.core.config import Settings
from app.core.storage import Storage
from app.domain.models import BatchRow
from app.engine.batch.ending import end_overdue, overdue
from app.engine.batch.run import Run
from app.engine.batch.runs import Runs

log = logging.getLogger("vbatch.engine")


class Watchdog:
    def __init__(self, runs: Runs, *, retry_seconds: float) -> None:
        self.runs = runs
        self.retry_seconds = retry_seconds
        # Overdue batches it could not end at all (no database write went through): tried again quietly.
        self._unended: set[str] = set()

    async def watch(self, db: Engine, storage: Storage, settings: Settings, rows: list[BatchRow]) -> list[BatchRow]:
        """End the overdue batches among `rows` (the active batches this service holds); returns the others."""
        ended = overdue(rows, settings)
        for row in ended:
            await self.runs.stop(row.id)
            await self._end(Run(row=row, lease=self.runs.lease(row.id), db=db, storage=storage, settings=settings))
        return [row for row in rows if row not in ended]

    async def _end(self, run: Run) -> None:
        """Whatever its lines hold, the batch ends (`end_overdue`); only a database that takes no write leaves it
        active, to be tried again at every look, logged the first time only."""
        quiet = run.id in self._unended
        if not quiet:
            log.error(
                "batch %s: still active %s s after its window; the watchdog ends it",
                run.id,
                run.settings.watchdog_grace_seconds,
            )
        if await end_overdue(run, quiet=quiet):
            self._unended.discard(run.id)
        elif not quiet:
            log.error("batch %s: the watchdog could not end it; it tries again every %s s", run.id, self.retry_seconds)
            self._unended.add(run.id)
