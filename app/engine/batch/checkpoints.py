"""A running batch's checkpoints and its ticks.

Every `checkpoint_seconds` a tick takes a checkpoint: the part files fsynced and their lengths, counts and engine time
committed (`parts.py`) in one write that also renews the run's lease and tells a cancel. On an object store a full
checkpoint ships a segment, one each `segment_seconds`; the ticks between save the live numbers alone. A tick also
stops the run at its window's end, samples its speed (`meter.py`) and logs its progress now and then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from app.domain import batches, leases
from app.domain.lifecycle import BatchStatus
from app.domain.schemas import RunStats
from app.engine.batch.context import Context
from app.engine.batch.meter import RunMeter
from app.engine.batch.parts import Checkpoint, ResultSink
from app.engine.batch.run import Run

log = logging.getLogger("vbatch.runner")


class Checkpoints:
    def __init__(
        self, ctx: Context, run: Run, sink: ResultSink, meter: RunMeter, live: Callable[[], RunStats | None]
    ) -> None:
        self.ctx = ctx
        self.run = run
        self.row = run.row  # as the run began
        self.sink = sink
        self.meter = meter
        self.live = live
        self.last_log = time.monotonic()
        self._saved_status: BatchStatus | None = None  # as the last checkpoint's write found it
        self._held_at = -float("inf")  # time.monotonic() when the last checkpoint's write (which renews it) began
        self._shipped_at = -float("inf")  # time.monotonic() of the last full checkpoint

    async def take(self) -> BatchStatus | None:
        """The batch's status as the checkpoint's write found it (None: it wrote nothing)."""
        # With the disk full, results stop here: the room left is for the database to end the batch.
        self.ctx.storage.check_room()
        if self.sink.ship is not None and not self._surely_held():
            # Segments are written before their commit: not by a run that lost its lease.
            leases.check(await self.run.stored(), self.run.lease)
        self.charge()
        self._saved_status = None
        self._shipped_at = time.monotonic()
        with self.ctx.metrics.checkpoint_seconds.time():
            await self.sink.checkpoint(self._save)
        return self._saved_status

    def charge(self) -> None:
        """The engine time the batch's lines used since the last charge, into its counts."""
        self.sink.progress.gpu_seconds += self.ctx.engine.engine_time.take(self.row.id)

    async def tick(self, stop: asyncio.Future) -> None:
        """Resolves `stop` with the status that stops the run, or with the error a tick raised (a full disk, a lost
        lease, a database that takes no write): a run without ticks would go on with no checkpoint, deaf to a cancel."""
        try:
            status = await self._ticks()
        except Exception as exc:
            stop.set_exception(exc)
        else:
            stop.set_result(status)

    async def _ticks(self) -> BatchStatus:
        while True:
            await asyncio.sleep(self.ctx.settings.checkpoint_seconds)
            if await self._tick_save() == BatchStatus.CANCELLING:
                return BatchStatus.CANCELLED
            if self.run.expired():
                return BatchStatus.EXPIRED
            self.meter.sample(self.sink.progress)
            self._log_progress()

    async def _tick_save(self) -> BatchStatus | None:
        """A checkpoint; on an object store, one each `segment_seconds` (each ships a segment), the live numbers
        between."""
        lease = self.run.lease
        apart = time.monotonic() - self._shipped_at
        if self.sink.ship is None or lease is None or apart >= self.ctx.settings.segment_seconds:
            return await self.take()
        writing = time.monotonic()
        status = await asyncio.to_thread(
            batches.save_live,
            db=self.ctx.db,
            batch_id=self.row.id,
            lease=lease,
            lease_seconds=self.ctx.settings.lease_seconds,
            live=self.live(),
        )
        self._held_at = writing
        return status

    def _save(self, checkpoint: Checkpoint) -> None:
        writing = time.monotonic()
        self._saved_status = batches.save_checkpoint(
            db=self.ctx.db,
            batch_id=self.row.id,
            progress=checkpoint.progress,
            output_bytes=checkpoint.output_bytes,
            error_bytes=checkpoint.error_bytes,
            lease=self.run.lease,
            lease_seconds=self.ctx.settings.lease_seconds,
            live=self.live(),
        )
        self._held_at = writing

    def _surely_held(self) -> bool:
        """Whether the lease is still this run's for sure, without a read: each checkpoint's write renews it, so
        within half a lease of the last one (the other half for clocks apart) no other service can have taken it."""
        return time.monotonic() - self._held_at < self.ctx.settings.lease_seconds / 2

    def _log_progress(self) -> None:
        now = time.monotonic()
        if now - self.last_log < self.ctx.settings.progress_log_seconds:
            return
        self.last_log = now
        stats = self.live()
        if stats is None:
            return
        progress = self.sink.progress
        log.info(
            "batch %s: %d/%d done, %.1f req/s, %.0f output tok/s, ETA %s",
            self.row.id,
            progress.completed + progress.failed,
            self.row.total,
            stats.requests_per_second,
            stats.output_tokens_per_second,
            "unknown yet" if stats.eta_seconds is None else f"{stats.eta_seconds:.0f}s",
        )
