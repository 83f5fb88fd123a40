"""One batch's story, top to bottom: resolved once into a `Run` (`run.py`), validated (`intake.py`), then planned
and fed (`BatchRun`) or, cut into shards, waited for and joined (`shards.py`), finished, and ended at one exit,
`ending.end`, which chooses the ending from what the story tells (a `RunOutcome`): completed, cancelled, expired, or
failed with a full disk.

Results are appended to part files as they complete (`parts.py`) and checkpointed on each tick, every
`checkpoint_seconds` (`checkpoints.py`); when the engine dies the batch waits for a new one and re-runs what was in
flight, isolated, until a line that kills the engine on its own is found and written to the error file
(`suspects.py`); at the end the part files become File objects in the same transaction that ends the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from types import TracebackType

from app.core import failpoints
from app.core.disk import is_disk_full
from app.domain.cost import weighed_tokens
from app.domain.input_index import InputIndex
from app.domain.leases import Lease
from app.domain.lifecycle import BatchStatus
from app.domain.online import batch_line_body
from app.domain.results import Outcome
from app.domain.schemas import RunStats
from app.engine.batch.checkpoints import Checkpoints
from app.engine.batch.context import Context
from app.engine.batch.ending import (
    CancelledFirst,
    OutOfDisk,
    Ran,
    RunOutcome,
    Unserved,
    end,
    record_unfinished,
    unserved,
)
from app.engine.batch.intake import take_in
from app.engine.batch.meter import RunMeter
from app.engine.batch.ordering import Group, adapter_gate, ordered_lines, pin_to_ranks, plan
from app.engine.batch.run import Run
from app.engine.batch.shards import run_parent
from app.engine.batch.suspects import Suspects
from app.engine.inference.serving import EngineDead
from app.engine.sharing.execution import Executor, FixedSlots, TimedExecutor, run_lines
from app.engine.sharing.feed import Turn
from app.engine.telemetry.metrics import BATCH, Payer, key_label

log = logging.getLogger("vbatch.runner")

# How often a batch waiting for room on a full disk looks again, besides when a batch is created or cancelled; the
# reserve is written back, and so the room is seen, at the scheduler's look, each second.
ROOM_POLL_SECONDS = 1.0


async def run_batch(ctx: Context, batch_id: str, lease: Lease | None) -> None:
    """Run the batch to its end under `lease`: its story, then its ending (`ending.end`, the one exit); a full disk,
    in either, ends it at once, failed, with what its last checkpoint holds. The batch is resolved here, once, into
    the `Run` every step receives."""
    run = await Run.resolve(db=ctx.db, storage=ctx.storage, settings=ctx.settings, batch_id=batch_id, lease=lease)
    try:
        # What the story holds until its batch has ended (a run's live numbers, its sink); let go before a full
        # disk's ending, which opens the part files again from the checkpoint.
        async with AsyncExitStack() as held:
            outcome = await _story(ctx, run, held)
            if outcome is not None:
                await end(run, outcome)
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        await end(run, OutOfDisk())


async def _story(ctx: Context, run: Run, held: AsyncExitStack) -> RunOutcome | None:
    """validate -> plan (or shards) -> feed -> finish: what happened, for `end` to choose the ending from; None when
    the batch is not this run's to end (it has ended meanwhile)."""
    if unserved(run.row, ctx.served_models):
        return Unserved()
    if (refused := await take_in(ctx, run)) is not None:
        return refused
    if run.waits_for_shards:
        return await run_parent(ctx, run)
    if run.runs_own_lines and run.index is not None:
        batch = await held.enter_async_context(BatchRun(ctx, run, run.index))
        return await batch.run_to_finish()
    if run.row.status == BatchStatus.CANCELLING:
        return CancelledFirst()
    return None


class BatchRun:
    """A batch's own lines, planned and fed to the engine until each has its result or a tick stops them."""

    def __init__(self, ctx: Context, run: Run, index: InputIndex) -> None:
        self.ctx = ctx
        self.run = run
        self.row = run.row  # as the run began
        self.index = index
        self.sink = run.new_sink(observe=ctx.metrics.result)
        self.input_path = ctx.storage.path(run.input_name)  # or its local copy, once the run begins
        self.meter = RunMeter(total=self.row.total, wave=ctx.wave, generated_tokens=ctx.engine.generated_tokens)
        self.checkpoints = Checkpoints(ctx, run, self.sink, self.meter, live=self.stats)
        self.suspects = Suspects(ctx, self.row.id, index, self.sink, run_alone=self._run_alone)
        self._engine_body = batch_line_body(
            tenant=self.row.owner, by_priority=ctx.batch_priority, shared_cache=ctx.settings.shared_prefix_cache
        )
        self.payer = Payer(BATCH, key_label(self.row.owner), self.row.model or "", self.row.id)

    def stats(self) -> RunStats | None:
        """From any thread: the API reads it while the batch runs (None until the run has begun)."""
        return self.meter.stats(self.sink.progress)

    async def __aenter__(self) -> BatchRun:
        """Shown (its live numbers) until its batch has ended."""
        self.ctx.runs.show(self.row.id, self)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.ctx.runs.hide(self.row.id, self)
        await self.sink.abandon()  # after an error: its files are closed now, not when collected

    async def run_to_finish(self) -> Ran:
        """Feed its lines until every one has its result, or a cancel or its window's end stops it (the others then
        get their error line); its results, to end the batch with."""
        self.input_path = await self.ctx.storage.local_path(self.run.input_name)
        await self.run.begin_parts(self.sink, self.index.position_of)
        if self.row.status == BatchStatus.FINALIZING:  # stopped while publishing: every line has its result
            return self._finished(BatchStatus.COMPLETED)
        stop_status = None
        try:
            if self.row.status == BatchStatus.IN_PROGRESS and not self.run.expired():
                stop_status = await self._execute()
            else:
                stop_status = (
                    BatchStatus.CANCELLED if self.row.status == BatchStatus.CANCELLING else BatchStatus.EXPIRED
                )
        finally:
            # What it recorded before it stopped; one stopped before its feed began (in a wait for its turn, or for
            # room on a full disk, whose check would fail it at a service's stop) recorded nothing.
            if self.meter.began:
                await self.checkpoints.take()
        if stop_status is None:
            return self._finished(BatchStatus.COMPLETED)
        record_unfinished(self.sink, self.index, stop_status)
        await self.checkpoints.take()
        return self._finished(stop_status)

    async def _execute(self) -> BatchStatus | None:
        """None when every line finished; else the terminal status that stopped it."""
        turn = await self._wait_for_turn()
        if isinstance(turn, BatchStatus):
            return turn
        if (ended := await self._wait_for_room()) is not None:
            turn.release()
            return ended
        # Its numbers count from its turn, not its wait.
        self.meter.begin(done_before=len(self.sink.done), created_ns=self.row.created_ns)
        stop = asyncio.get_running_loop().create_future()
        ticker = asyncio.create_task(self.checkpoints.tick(stop))
        work = asyncio.create_task(self._work(turn))
        try:
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
            if stop.done():
                work.cancel()
                # gather, not suppress(CancelledError): a cancel of this run itself must not be swallowed here.
                await asyncio.gather(work, return_exceptions=True)
                return stop.result()
            work.result()
            return None
        finally:
            for task in (ticker, work):
                task.cancel()
            await asyncio.gather(ticker, work, return_exceptions=True)
            if stop.done() and not stop.cancelled():
                stop.exception()  # read when a cancel came with it, or asyncio reports it never retrieved
            turn.release()  # a run stopped before its feed began has not passed its turn on

    async def _wait_for_turn(self) -> Turn | BatchStatus:
        """The turn to feed the engine; or, if the batch is cancelled or expires first, the status it ends with.
        Waiting costs nothing: the batch looks at its status only when the service says something changed."""
        return await self.ctx.feed.turn_or_end(
            owner=self.row.owner,
            created_ns=self.row.created_ns,
            batch_id=self.row.id,
            changes=self.ctx.changes,
            deadline=self.row.expires_at,
            ending=self._ended_while_waiting,
        )

    async def _wait_for_room(self) -> BatchStatus | None:
        """None once the disk has room for results; or, if the batch is cancelled or expires first, the status it
        ends with. A batch whose turn comes while the disk is full waits: its checkpoint loses nothing by waiting,
        while its first tick would fail it with what it has (the batch writing when the disk filled has failed so),
        and every batch queued behind it after it, each in its turn."""
        waited = False
        while not self.ctx.storage.has_room():
            if not waited:
                log.warning("batch %s: its turn came with the disk full; it waits for room", self.row.id)
                waited = True
            changed = self.ctx.changes.watch()  # before the look: a cancel while it looks is not missed
            if (ended := await self._ended_while_waiting()) is not None:
                return ended
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ROOM_POLL_SECONDS):
                    await changed.wait()
        if waited:
            log.info("batch %s: the disk has room again; its lines run", self.row.id)
        return None

    async def _ended_while_waiting(self) -> BatchStatus | None:
        if self.run.expired():
            return BatchStatus.EXPIRED
        if (await self.run.stored()).status == BatchStatus.CANCELLING:
            return BatchStatus.CANCELLED
        return None

    async def _work(self, first_turn: Turn) -> None:
        """Every pending line to the engine; after an engine death, the lines it took with it first."""
        groups = await asyncio.to_thread(plan, self.index)
        pin_to_ranks(groups, self.ctx.ranks)
        self.meter.mark("planned")
        suspects: list[int] = []
        turn: Turn | None = first_turn
        while True:
            if suspects:
                await self.suspects.rerun(suspects)
            generation = self.ctx.engine.generation
            in_flight: set[int] = set()
            try:
                await self._feed(groups, in_flight, turn)
                return
            except EngineDead:
                turn = None  # passed on: the re-run waits for a turn of its own
                suspects = sorted(in_flight - self.sink.done)
                log.warning("batch %s: the engine died with %d of its lines in flight", self.row.id, len(suspects))
                await self.ctx.engine.recover(generation)

    async def _feed(self, groups: list[Group], in_flight: set[int], turn: Turn | None) -> None:
        ctx = self.ctx
        if turn is None:
            turn = await ctx.feed.turn(owner=self.row.owner, created_ns=self.row.created_ns, batch_id=self.row.id)

        def release() -> None:
            self.meter.mark("all_sent")
            turn.release()

        gate = adapter_gate(self.index, ctx.max_loras)
        if gate is not None:
            log.info(
                "batch %s: lines of %d LoRA adapters, fed %d adapters at a time",
                self.row.id,
                self.index.adapter_count,
                ctx.max_loras,
            )
        try:
            lines = ordered_lines(self.input_path, self.index, groups, skip=self.sink.done)
            await run_lines(
                failpoints.ARMED.held(lines, ctx.settings.data_dir),
                executor=self._timed(ctx.engine),
                endpoint=self.row.endpoint,
                slots=ctx.window,
                workers=ctx.max_in_flight,
                on_outcome=self._record,
                on_all_submitted=release,
                in_flight=in_flight,
                engine_body=self._engine_body,
                gate=gate,
                pacer=ctx.window.pacer,
                ramp=ctx.wave,
            )
        finally:
            release()

    async def _run_alone(self, positions: list[int], executor: Executor) -> None:
        """These lines through `executor`, the engine's alone (`Suspects`)."""
        await run_lines(
            self._lines(positions),
            executor=self._timed(executor),
            endpoint=self.row.endpoint,
            slots=FixedSlots(len(positions)),
            workers=len(positions),
            on_outcome=self._record,
            engine_body=self._engine_body,
        )

    async def _lines(self, positions: list[int]) -> AsyncIterator[tuple[int, dict, int | None]]:
        for position, request in self.index.requests(self.input_path, positions):
            yield position, request, None

    def _timed(self, executor: Executor) -> TimedExecutor:
        """The lines' seconds in flight go to the engine's time: those of a line withdrawn or aborted are its
        batch's to pay, though it tells no tokens (`app.domain.cost`)."""
        engine_time = self.ctx.engine.engine_time
        return TimedExecutor(
            executor, lambda seconds, answered: engine_time.timed(self.payer, seconds, answered=answered)
        )

    def _record(self, position: int, outcome: Outcome) -> None:
        self.sink.record(position, outcome)
        self.ctx.engine.engine_time.used(self.payer, weighed_tokens(outcome.usage))
        self.meter.result()

    def _finished(self, status: BatchStatus) -> Ran:
        self.meter.mark("published")
        self.meter.sample(self.sink.progress, last=True)
        self.checkpoints.charge()
        timer = self.ctx.metrics.publish_seconds.time()
        return Ran(self.sink, status, timeline=self.meter.timeline, series=self.meter.series(), timer=timer)
