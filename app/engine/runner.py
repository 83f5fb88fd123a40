"""One batch's life in the engine loop: validate, run, finalize, or stop for cancel and expiry.

Results are appended to part files as they complete and checkpointed every `checkpoint_seconds` (`parts.py`);
when the engine dies the batch waits for a new one and re-runs what was in flight, isolated, until a line that
kills the engine on its own is found and written to the error file; at the end the part files become File
objects in the same transaction that ends the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from app import batches, clock, failpoints, files
from app.config import Settings
from app.engine.execution import EngineDead, run_lines
from app.engine.live import LiveEngine
from app.engine.ordering import Group, ordered_lines, plan
from app.engine.parts import PartFiles
from app.ids import new_id
from app.models import BatchRow, FileRow
from app.results import CANCELLED_MESSAGE, EXPIRED_MESSAGE, Outcome, error_outcome
from app.schemas import BatchError
from app.storage import ResultAppender, Storage
from app.validation import Limits, request_lines, validate_file

log = logging.getLogger("vbatch.runner")

ENGINE_CRASH_CODE = "engine_crashed"
# Lines in flight at an engine death are re-run in this many groups, one group at a time.
SUSPECT_FANOUT = 8


@dataclass
class Context:
    db: Engine
    storage: Storage
    settings: Settings
    engine: LiveEngine
    served_models: list[str]
    max_in_flight: int
    slots: asyncio.Semaphore
    # Held while a batch submits its lines: batches start in creation order and overlap only at the tail.
    feed_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


async def run_batch(ctx: Context, batch_id: str) -> None:
    row = batches.get(db=ctx.db, batch_id=batch_id, owner=None)
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
        max_choices=ctx.settings.max_choices_per_request,
    )
    try:
        source = files.get(db=ctx.db, file_id=row.input_file_id, owner=None)
        report = await asyncio.to_thread(validate_file, ctx.storage.path(source.id), limits)
    except Exception as exc:  # the input file vanished (deleted) or cannot be read
        log.warning("batch %s: input file unreadable: %s", row.id, type(exc).__name__)
        return _fail(ctx, row, [("file_not_found", f"The input file {row.input_file_id} cannot be read.")])
    current = batches.get(db=ctx.db, batch_id=row.id, owner=None)
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
        self.parts = PartFiles(ctx.storage, row)
        self.input_path = ctx.storage.path(row.input_file_id)
        self.deaths_alone: dict[int, int] = {}
        self.started = time.monotonic()
        self.last_log = self.started
        # Seconds from the start of this run to each stage; logged at the end, so an operator (or a benchmark)
        # can see where a batch's time went: planning, sending, the engine, publishing.
        self.timeline: dict[str, float] = {}

    async def run(self) -> None:
        await self.parts.open()
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
            await self.parts.checkpoint(self.ctx.db)
        if stop_status is None:
            await self._finish("completed")
        else:
            await self._fill_unfinished(stop_status)
            await self._finish(stop_status)

    def _expired(self) -> bool:
        return self.row.expires_at is not None and clock.now() >= self.row.expires_at

    async def _execute(self) -> str | None:
        """None when every line finished; else the terminal status that stopped it."""
        stop = asyncio.get_running_loop().create_future()
        ticker = asyncio.create_task(self._tick(stop))
        work = asyncio.create_task(self._work())
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
            for task in (ticker, work):
                task.cancel()
            await asyncio.gather(ticker, work, return_exceptions=True)

    async def _work(self) -> None:
        """Every pending line to the engine; after an engine death, the lines it took with it first."""
        groups = await asyncio.to_thread(plan, self.input_path)
        self._mark("planned")
        suspects: list[int] = []
        while True:
            if suspects:
                await self._settle(suspects)
            generation = self.ctx.engine.generation
            in_flight: set[int] = set()
            try:
                await self._feed(groups, in_flight)
                return
            except EngineDead:
                suspects = sorted(in_flight - self.parts.done)
                log.warning("batch %s: the engine died with %d of its lines in flight", self.row.id, len(suspects))
                await self.ctx.engine.recover(generation)

    async def _feed(self, groups: list[Group], in_flight: set[int]) -> None:
        ctx = self.ctx
        await ctx.feed_lock.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._mark("all_sent")
                ctx.feed_lock.release()

        try:
            await run_lines(
                failpoints.held(ordered_lines(self.input_path, groups, skip=self.parts.done), ctx.settings.data_dir),
                executor=ctx.engine,
                endpoint=self.row.endpoint,
                slots=ctx.slots,
                workers=ctx.max_in_flight,
                on_outcome=self._record,
                on_all_submitted=release,
                in_flight=in_flight,
            )
        finally:
            release()

    async def _settle(self, suspects: list[int]) -> None:
        """Re-run the lines an engine death took, a group at a time with nothing else in flight; a group that kills
        the engine again is split, down to single lines. A line that kills it alone `engine_deaths_per_line` times
        goes to the error file."""
        queue = deque(_split(suspects))
        while queue:
            group = [n for n in queue.popleft() if n not in self.parts.done]
            if not group:
                continue
            generation = self.ctx.engine.generation
            try:
                async with self.ctx.engine.isolated() as executor:
                    await run_lines(
                        self._lines(group),
                        executor=executor,
                        endpoint=self.row.endpoint,
                        slots=asyncio.Semaphore(len(group)),
                        workers=len(group),
                        on_outcome=self._record,
                    )
            except EngineDead:
                await self.ctx.engine.recover(generation)
                unfinished = [n for n in group if n not in self.parts.done]
                if len(unfinished) == 1:
                    await self._blame(unfinished[0], queue)
                else:
                    queue.extendleft(reversed(_split(unfinished)))

    async def _blame(self, number: int, queue: deque[list[int]]) -> None:
        deaths = self.deaths_alone.get(number, 0) + 1
        self.deaths_alone[number] = deaths
        if deaths < self.ctx.settings.engine_deaths_per_line:
            queue.appendleft([number])
            return
        log.error(
            "batch %s: line %d killed the engine %d times on its own; it goes to the error file",
            self.row.id,
            number,
            deaths,
        )
        async for _, request in self._lines([number]):
            message = f"The engine died {deaths} times while running this request alone; it was not retried."
            self.parts.record(number, error_outcome(request["custom_id"], ENGINE_CRASH_CODE, message))

    async def _lines(self, numbers: list[int]) -> AsyncIterator[tuple[int, dict]]:
        wanted = set(numbers)
        for number, request in request_lines(self.input_path):
            if number in wanted:
                yield number, request

    def _record(self, number: int, outcome: Outcome) -> None:
        self.parts.record(number, outcome)
        now = time.monotonic() - self.started
        self.timeline.setdefault("first_result", now)
        self.timeline["last_result"] = now

    def _mark(self, stage: str) -> None:
        self.timeline.setdefault(stage, time.monotonic() - self.started)

    async def _tick(self, stop: asyncio.Future) -> None:
        while True:
            await asyncio.sleep(self.ctx.settings.checkpoint_seconds)
            await self.parts.checkpoint(self.ctx.db)
            status = batches.get(db=self.ctx.db, batch_id=self.row.id, owner=None).status
            if status == "cancelling":
                stop.set_result("cancelled")
                return
            if self._expired():
                stop.set_result("expired")
                return
            self._log_progress()

    def _log_progress(self) -> None:
        now = time.monotonic()
        if now - self.last_log < self.ctx.settings.progress_log_seconds:
            return
        self.last_log = now
        elapsed = max(now - self.started, 1e-6)
        progress = self.parts.progress
        finished = progress.completed + progress.failed
        rate = finished / elapsed
        eta = (self.row.total - finished) / rate if rate > 0 else float("inf")
        log.info(
            "batch %s: %d/%d done, %.1f req/s, %.0f output tok/s, ETA %s",
            self.row.id,
            finished,
            self.row.total,
            rate,
            progress.output_tokens / elapsed,
            f"{eta:.0f}s" if eta != float("inf") else "?",
        )

    async def _fill_unfinished(self, status: str) -> None:
        code, message = (
            ("batch_cancelled", CANCELLED_MESSAGE) if status == "cancelled" else ("batch_expired", EXPIRED_MESSAGE)
        )
        for number, request in request_lines(self.input_path):
            if number not in self.parts.done:
                self.parts.record(number, error_outcome(request["custom_id"], code, message))
        await self.parts.checkpoint(self.ctx.db)

    async def _finish(self, status: str) -> None:
        """Result files get their rows in the transaction that ends the batch; the part files go only after it."""
        ctx = self.ctx
        if status == "completed" and self.row.status != "finalizing":
            batches.transition(db=ctx.db, batch_id=self.row.id, to="finalizing")
        await self.parts.close()
        output = await self._link(self.parts.output, "output")
        error = await self._link(self.parts.errors, "error")
        failpoints.crash_here(failpoints.RESULTS_LINKED)
        batches.transition(
            db=ctx.db,
            batch_id=self.row.id,
            to=status,
            new_files=[row for row in (output, error) if row is not None],
            output_file_id=output.id if output else None,
            error_file_id=error.id if error else None,
            **vars(self.parts.progress),
        )
        for appender in (self.parts.output, self.parts.errors):
            await ctx.storage.delete(appender.path.name)
        progress = self.parts.progress
        log.info("batch %s: %s, %d completed, %d failed", self.row.id, status, progress.completed, progress.failed)
        self._mark("published")
        stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in self.timeline.items())
        log.info("batch %s: timeline in seconds from the start of this run: %s", self.row.id, stages)

    async def _link(self, appender: ResultAppender, kind: str) -> FileRow | None:
        if appender.lines == 0:
            return None
        file_id = new_id("file-")
        await self.ctx.storage.link(appender.path.name, file_id)
        created = clock.now()
        ttl = self.row.output_expires_after_seconds or self.ctx.settings.output_file_ttl_seconds
        return FileRow(
            id=file_id,
            created_ns=clock.now_ns(),
            created_at=created,
            expires_at=created + ttl,
            bytes=await self.ctx.storage.size(file_id),
            filename=f"{self.row.id}_{kind}.jsonl",
            purpose=files.OUTPUT_PURPOSE,
            batch_id=self.row.id,
            owner=self.row.owner,
        )


def _split(numbers: list[int]) -> list[list[int]]:
    size = -(-len(numbers) // SUSPECT_FANOUT)
    return [numbers[i : i + size] for i in range(0, len(numbers), size)]
