"""One batch's life in the engine loop: validate, run, finalize, or stop for cancel and expiry.

Results are appended to `<batch>.output.part` / `<batch>.error.part` as they complete; counts and usage reach
SQLite at least every `counts_flush_seconds`; at the end the part files become File objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from app import batches, clock, files
from app.batches import Progress
from app.config import Settings
from app.engine.execution import Executor, run_lines, warmer
from app.engine.ordering import ordered_lines, plan
from app.engine.resume import finished_lines
from app.ids import new_id
from app.models import BatchRow, FileRow
from app.results import CANCELLED_MESSAGE, EXPIRED_MESSAGE, Outcome, add_usage, error_outcome, line_for
from app.schemas import BatchError
from app.storage import ResultAppender, Storage
from app.validation import Limits, request_lines, validate_file

log = logging.getLogger("vbatch.runner")


@dataclass
class Context:
    db: Engine
    storage: Storage
    settings: Settings
    executor: Executor
    served_models: list[str]
    max_in_flight: int
    slots: asyncio.Semaphore
    # Held while a batch submits its lines: batches start in creation order and overlap only at the tail.
    feed_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def part_names(batch_id: str) -> tuple[str, str]:
    return f"{batch_id}.output.part", f"{batch_id}.error.part"


async def run_batch(ctx: Context, batch_id: str) -> None:
    row = batches.get(db=ctx.db, batch_id=batch_id)
    if row.status == "validating":
        row = await _validate(ctx, row)
    if row.status in ("in_progress", "cancelling", "finalizing") and row.in_progress_at is not None:
        await BatchRun(ctx, row).run()
    elif row.status == "cancelling":
        batches.transition(db=ctx.db, batch_id=row.id, to="cancelled")


async def _validate(ctx: Context, row: BatchRow) -> BatchRow:
    limits = Limits(
        endpoint=row.endpoint,
        served_models=frozenset(ctx.served_models),
        max_requests=ctx.settings.max_requests_per_batch,
        max_line_bytes=ctx.settings.max_line_bytes,
    )
    try:
        source = files.get(db=ctx.db, file_id=row.input_file_id)
        report = await asyncio.to_thread(validate_file, ctx.storage.path(source.id), limits)
    except Exception as exc:  # the input file vanished (deleted) or cannot be read
        log.warning("batch %s: input file unreadable: %s", row.id, type(exc).__name__)
        return _fail(ctx, row, [("file_not_found", f"The input file {row.input_file_id} cannot be read.")])
    current = batches.get(db=ctx.db, batch_id=row.id)
    if current.status != "validating":  # cancelled while we read
        return current
    if not report.ok:
        log.info("batch %s: failed validation with %d errors", row.id, report.error_count)
        return batches.transition(
            db=ctx.db, batch_id=row.id, to="failed", errors_json=batches.errors_json(report.errors)
        )
    model = report.model or (ctx.served_models[0] if ctx.served_models else None)
    log.info("batch %s: %d requests validated", row.id, report.total)
    return batches.transition(db=ctx.db, batch_id=row.id, to="in_progress", total=report.total, model=model)


def _fail(ctx: Context, row: BatchRow, problems: list[tuple[str, str]]) -> BatchRow:
    errors = [BatchError(code=code, message=message) for code, message in problems]
    return batches.transition(db=ctx.db, batch_id=row.id, to="failed", errors_json=batches.errors_json(errors))


class BatchRun:
    def __init__(self, ctx: Context, row: BatchRow) -> None:
        self.ctx = ctx
        self.row = row
        self.progress = Progress()
        self.done: set[int] = set()
        output_name, error_name = part_names(row.id)
        self.output = ctx.storage.open_appender(output_name)
        self.errors = ctx.storage.open_appender(error_name)
        self.started = time.monotonic()
        self.last_log = self.started

    async def run(self) -> None:
        await self._resume()
        await self.output.open()
        await self.errors.open()
        if self.row.status == "finalizing":  # stopped while publishing: every line already has its result
            await self._finish("completed")
            return
        stop_status = None
        try:
            if self.row.status == "in_progress" and not self._expired():
                stop_status = await self._execute()
            else:
                stop_status = "cancelled" if self.row.status == "cancelling" else "expired"
        finally:
            await self._checkpoint()
        if stop_status is None:
            await self._finish("completed")
        else:
            await self._fill_unfinished(stop_status)
            await self._finish(stop_status)

    async def _resume(self) -> None:
        """After a restart, results already in the part files count as done and are not sent to the engine."""
        input_path = self.ctx.storage.path(self.row.input_file_id)
        finished = await asyncio.to_thread(finished_lines, input_path, self.output.path, self.errors.path)
        self.done, self.progress = finished.lines, finished.progress
        self.output.lines, self.errors.lines = finished.output_lines, finished.error_lines
        if self.done:
            log.info("batch %s: resuming, %d of %d lines already done", self.row.id, len(self.done), self.row.total)

    def _pending_lines(self):
        return (
            line for line in request_lines(self.ctx.storage.path(self.row.input_file_id)) if line[0] not in self.done
        )

    def _expired(self) -> bool:
        return self.row.expires_at is not None and clock.now() >= self.row.expires_at

    async def _execute(self) -> str | None:
        """None when every line finished; else the terminal status that stopped it."""
        ctx = self.ctx
        stop = asyncio.get_running_loop().create_future()
        ticker = asyncio.create_task(self._tick(stop))
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                ctx.feed_lock.release()

        input_path = ctx.storage.path(self.row.input_file_id)
        groups = await asyncio.to_thread(plan, input_path)
        await ctx.feed_lock.acquire()
        lines = ordered_lines(input_path, groups, skip=self.done, warm=warmer(ctx.executor, self.row.endpoint))
        work = asyncio.create_task(
            run_lines(
                lines,
                executor=ctx.executor,
                endpoint=self.row.endpoint,
                slots=ctx.slots,
                workers=ctx.max_in_flight,
                on_outcome=self._record,
                on_all_submitted=release,
            )
        )
        try:
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return stop.result()
            work.result()
            return None
        finally:
            release()
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            if not work.done():
                work.cancel()

    def _record(self, number: int, outcome: Outcome) -> None:
        self.done.add(number)
        if outcome.succeeded:
            self.output.add(line_for(outcome))
            self.progress.completed += 1
        else:
            self.errors.add(line_for(outcome))
            self.progress.failed += 1
        add_usage(self.progress, outcome.body)

    async def _tick(self, stop: asyncio.Future) -> None:
        while True:
            await asyncio.sleep(self.ctx.settings.counts_flush_seconds)
            await self._checkpoint()
            status = batches.get(db=self.ctx.db, batch_id=self.row.id).status
            if status == "cancelling":
                stop.set_result("cancelled")
                return
            if self._expired():
                stop.set_result("expired")
                return
            self._log_progress()

    async def _checkpoint(self) -> None:
        await self.output.flush()
        await self.errors.flush()
        await asyncio.to_thread(batches.save_progress, db=self.ctx.db, batch_id=self.row.id, progress=self.progress)

    def _log_progress(self) -> None:
        now = time.monotonic()
        if now - self.last_log < self.ctx.settings.progress_log_seconds:
            return
        self.last_log = now
        elapsed = max(now - self.started, 1e-6)
        finished = self.progress.completed + self.progress.failed
        rate = finished / elapsed
        eta = (self.row.total - finished) / rate if rate > 0 else float("inf")
        log.info(
            "batch %s: %d/%d done, %.1f req/s, %.0f output tok/s, ETA %s",
            self.row.id,
            finished,
            self.row.total,
            rate,
            self.progress.output_tokens / elapsed,
            f"{eta:.0f}s" if eta != float("inf") else "?",
        )

    async def _fill_unfinished(self, status: str) -> None:
        code, message = (
            ("batch_cancelled", CANCELLED_MESSAGE) if status == "cancelled" else ("batch_expired", EXPIRED_MESSAGE)
        )
        for number, request in self._pending_lines():
            self._record(number, error_outcome(request["custom_id"], code, message))
        await self._checkpoint()

    async def _finish(self, status: str) -> None:
        ctx = self.ctx
        if status == "completed" and self.row.status != "finalizing":
            batches.transition(db=ctx.db, batch_id=self.row.id, to="finalizing")
        await self.output.close()
        await self.errors.close()
        output_id = await self._publish(self.output, "output")
        error_id = await self._publish(self.errors, "error")
        batches.transition(
            db=ctx.db,
            batch_id=self.row.id,
            to=status,
            output_file_id=output_id,
            error_file_id=error_id,
            **vars(self.progress),
        )
        log.info(
            "batch %s: %s, %d completed, %d failed",
            self.row.id,
            status,
            self.progress.completed,
            self.progress.failed,
        )

    async def _publish(self, appender: ResultAppender, kind: str) -> str | None:
        part = appender.path.name
        if appender.lines == 0:
            await self.ctx.storage.delete(part)
            return None
        file_id = new_id("file-")
        await self.ctx.storage.rename(part, file_id)
        created = clock.now()
        ttl = self.row.output_expires_after_seconds or self.ctx.settings.output_file_ttl_seconds
        files.insert(
            db=self.ctx.db,
            row=FileRow(
                id=file_id,
                created_ns=clock.now_ns(),
                created_at=created,
                expires_at=created + ttl,
                bytes=await self.ctx.storage.size(file_id),
                filename=f"{self.row.id}_{kind}.jsonl",
                purpose=files.OUTPUT_PURPOSE,
                batch_id=self.row.id,
            ),
        )
        return file_id
