"""Every way a batch ends, decided here and nowhere else: completed, failed, cancelled, expired, out of disk, from
its last checkpoint, a parent of shards, without its input, cancelled before it ran, and the watchdog's.

A batch's run tells what happened (a `RunOutcome`: `Unserved`, `Refused`, `InputGone`, `CancelledFirst`, `Ran`,
`OutOfDisk`) and `end`, the run's one exit, chooses the ending from it. The one other caller is the watchdog, whose
`end_overdue` ends a batch whose run is stuck. Every terminal status is written by one function, `_write_end`
(`tests/unit/test_code_shape.py` checks that no other code writes one).

One rule chooses between them, `cancel_wins`: a batch being cancelled ends cancelled, whatever else would have
ended it. Every ending applies it to the batch as its run last saw it and, when the move is refused because a
cancel came in between, to the batch as it is now (`_settle`).

A run that ran ends its batch with its results (`Ran`): its result parts become File objects in the transaction that
makes it final. When it cannot, because the disk filled up under it (`OutOfDisk`), or it raised something unexpected,
or it outlived its completion window, `_end_from_checkpoint` ends the batch with what its last checkpoint holds: those
lines are in its output and error files, nothing is lost that was counted, and the batch stops holding a slot of
its key's active-batch limit. `end_overdue`, the watchdog's, ends it even when that raises: whatever its lines hold,
a batch ends. A batch that ends before it runs a line (its model unserved, its input invalid or gone, or cancelled
first) ends by `_end_unrun`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from app.core import clock, failpoints
from app.core.config import Settings
from app.core.disk import is_disk_full
from app.core.ids import new_id
from app.core.storage import ResultAppender, Storage
from app.domain import batches, files
from app.domain.batches import Progress
from app.domain.input_index import InputIndex
from app.domain.lifecycle import TERMINAL, BatchStatus, InvalidTransition
from app.domain.models import BatchRow, FileRow
from app.domain.results import CANCELLED_MESSAGE, EXPIRED_MESSAGE, error_outcome
from app.domain.schemas import BatchError
from app.engine.batch.parts import ResultSink
from app.engine.batch.run import Run

log = logging.getLogger("vbatch.runner")

T = TypeVar("T")

DISK_FULL = BatchError(
    code="insufficient_storage",
    message="The server's disk filled up while this batch ran. The requests that finished before are in its output "
    "and error files; submit the others again once there is space.",
)
RESULTS_NOT_WRITTEN = BatchError(
    code="results_not_written",
    message="This batch's results could not be written when it ended. The requests that finished before its last "
    "checkpoint are in its output and error files; submit the others again.",
)
NO_RESULTS_WRITTEN = BatchError(
    code="results_not_written",
    message="This batch's results could not be written when it ended, so it has no output or error file; submit its "
    "requests again.",
)


@dataclass(frozen=True)
class Unserved:
    """Its window ended before any worker served its model: no line ran."""


@dataclass(frozen=True)
class Refused:
    """Its input failed validation with `errors`: no line ran."""

    errors: Sequence[BatchError]


@dataclass(frozen=True)
class InputGone:
    """Its input cannot be read (deleted, or gone before vbatch kept its own): no line ran."""


@dataclass(frozen=True)
class CancelledFirst:
    """A cancel came before it ran a line."""


@dataclass(frozen=True)
class Ran:
    """It ran (or, a parent, its shards did) to `wanted`: completed, or stopped cancelled or expired, each line with
    its result in `sink`. `shards` go after the commit that ends their parent; `timer` times the ending."""

    sink: ResultSink
    wanted: BatchStatus
    timeline: dict[str, float] = field(default_factory=dict)
    series: Sequence[Sequence[float]] = ()
    errors: Sequence[BatchError] = ()
    shards: Sequence[BatchRow] = ()
    timer: AbstractContextManager[object] = field(default_factory=nullcontext)


@dataclass(frozen=True)
class OutOfDisk:
    """The disk filled up under it."""


# What a batch's run tells `end` about how it went; `end` chooses the ending.
RunOutcome = Unserved | Refused | InputGone | CancelledFirst | Ran | OutOfDisk


async def end(run: Run, outcome: RunOutcome) -> None:
    """The one exit of a batch's run: its ending, chosen from `outcome` (and by `cancel_wins`)."""
    match outcome:
        case Unserved():
            # Expired, as OpenAI ends a batch its completion window outlived (`failed` is for an input found
            # invalid, which this one never was). Its lines were never read: it has no result files.
            await _end_unrun(run, [model_not_served(run.row.model)], wanted=BatchStatus.EXPIRED)
        case Refused(errors):
            await _end_unrun(run, errors)
        case InputGone():
            await _end_unrun(run, [input_gone(run.row.input_file_id)])
        case CancelledFirst():
            await _end_unrun(run)
        case Ran():
            await _end_ran(run, outcome)
        case OutOfDisk():
            # The batch fails at once with what its last checkpoint holds (the reserve released, the room left is
            # the database's).
            run.storage.reserve.release()
            log.error("batch %s: the disk is full; the batch fails with the results it has", run.id)
            await _end_from_checkpoint(run, BatchStatus.FAILED, [DISK_FULL])


async def _end_ran(run: Run, ran: Ran) -> None:
    with ran.timer:
        await _end_with_results(run, ran.sink, ran.wanted, timeline=ran.timeline, series=ran.series, errors=ran.errors)
    if ran.shards:
        await batches.forget_shards(db=run.db, storage=run.storage, shards=ran.shards)
    if ran.timeline:
        fields = {"batch_id": run.id, "timeline": ran.timeline}
        log.info("batch %s: timeline %s", run.id, json.dumps(ran.timeline), extra=fields)


async def _write_end(
    run: Run, status: BatchStatus, *, errors: Sequence[BatchError] = (), results: dict[str, Any] | None = None
) -> BatchRow:
    """Every terminal status of a batch is written here (the move fails if another came first): with its result
    files and counts (`results`); or, ended before it ran a line, with `errors` alone, or, cancelled, nothing."""
    if results is not None:
        return await asyncio.to_thread(
            batches.end_with_files, db=run.db, batch_id=run.id, to=status, lease=run.lease, errors=errors, **results
        )
    if status == BatchStatus.CANCELLED:
        return await asyncio.to_thread(
            batches.transition, db=run.db, batch_id=run.id, to=BatchStatus.CANCELLED, lease=run.lease
        )
    return await asyncio.to_thread(
        batches.end_with_errors, db=run.db, batch_id=run.id, to=status, errors=errors, lease=run.lease
    )


# Makes the ending `cancel_wins` chose (a database move, on a thread); returns the batch as it left it, if it moved it.
Move = Callable[[BatchStatus], Awaitable[BatchRow | None]]


def cancel_wins(stored: BatchStatus, wanted: BatchStatus) -> BatchStatus:
    """How a batch stored as `stored` ends when its run would end it `wanted`: a cancel wins over whatever else would
    end it (its last line done, its window passed, its input invalid or gone, a full disk); a batch already
    finalizing had every line's result, and ends completed unless it fails."""
    if stored == BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED
    if stored == BatchStatus.FINALIZING and wanted != BatchStatus.FAILED:
        return BatchStatus.COMPLETED
    return wanted


async def _settle(run: Run, wanted: BatchStatus, move: Move) -> BatchStatus:
    """The ending `cancel_wins` gives for the batch as the run last saw it, made by `move`; when `move` is refused
    (`InvalidTransition`: a cancel came in between), the one it gives for the batch as it is now."""
    status = cancel_wins(run.row.status, wanted)
    try:
        moved = await move(status)
    except InvalidTransition:
        run.row = await run.stored()
        again = cancel_wins(run.row.status, wanted)
        if again == status or run.row.status in TERMINAL:
            raise
        status, moved = again, await move(again)
    if moved is not None:
        run.row = moved
    return status


def overdue(rows: Sequence[BatchRow], settings: Settings) -> list[BatchRow]:
    """The batches still active `watchdog_grace_seconds` after their completion window: a run ends its own batch at
    expiry, so one still going then is stuck. A parent of shards waits on them, and each shard is watched itself."""
    deadline = clock.now() - settings.watchdog_grace_seconds
    return [row for row in rows if row.expires_at is not None and row.expires_at < deadline and not row.shards]


def shards_ending(shards: Sequence[BatchRow]) -> BatchStatus:
    """How a parent of shards would end, from how they ended (its own cancel wins over it, as for any batch)."""
    ended = {shard.status for shard in shards}
    for status in (BatchStatus.CANCELLED, BatchStatus.EXPIRED, BatchStatus.FAILED):
        if status in ended:
            return status
    return BatchStatus.COMPLETED


def input_gone(input_file_id: str) -> BatchError:
    return BatchError(code="file_not_found", message=f"The input file {input_file_id} cannot be read.")


def model_not_served(model: str | None) -> BatchError:
    return BatchError(
        code="model_not_served",
        message=f"No worker served the model {model!r} before this batch's completion window ended; none of its "
        "requests ran.",
        param="model",
    )


async def _end_unrun(run: Run, errors: Sequence[BatchError] = (), wanted: BatchStatus = BatchStatus.FAILED) -> None:
    """A batch that ends without running a line more: `wanted` (failed: its input unreadable, invalid or gone)
    with `errors` or, being cancelled, cancelled, its run files gone first (nothing of its own is needed any
    more)."""

    async def move(status: BatchStatus) -> BatchRow:
        if status == BatchStatus.CANCELLED:
            await _delete_all(run.storage, run.run_files)
        return await _write_end(run, status, errors=errors)

    status = await _settle(run, wanted, move)
    log.info("batch %s: %s before it ran", run.id, status, extra={"batch_id": run.id, "event": f"batch.{status}"})


def unserved(row: BatchRow, served_models: Sequence[str]) -> bool:
    """A batch still validating whose window has ended for a model this service does not serve: it was claimed
    only to be ended (`app.domain.leases.claim`), no service having served its model meanwhile."""
    ended = row.expires_at is not None and row.expires_at <= clock.now()
    return row.status == BatchStatus.VALIDATING and ended and row.model not in (None, *served_models)


async def _end_with_results(
    run: Run,
    sink: ResultSink,
    wanted: BatchStatus,
    *,
    timeline: dict[str, float],
    series: Sequence[Sequence[float]] = (),
    errors: Sequence[BatchError] = (),
) -> None:
    """Close the sink, give each non-empty part a File row, end the batch with them (under its lease, if it still
    holds), then drop its run files. A batch that ends completed is finalizing first: a cancel from then on is
    refused, and one that came before wins."""
    wanted = await _settle(run, wanted, partial(_finalizing, run))
    await sink.close()
    failpoints.ARMED.raise_here(failpoints.PUBLISH_RAISES)
    output = await _result_file(run, sink.output, "output")
    error = await _result_file(run, sink.errors, "error")
    failpoints.ARMED.crash_here(failpoints.RESULTS_LINKED)

    results = {"output": output, "error": error, "progress": sink.progress, "timeline": timeline, "series": series}
    commit = partial(_write_end, run, errors=errors, results=results)
    status = await _unstoppable(_commit_then_delete(run, wanted, commit))
    done = {"completed": sink.progress.completed, "failed": sink.progress.failed}
    fields = {"batch_id": run.id, "event": f"batch.{status}", **done}
    log.info("batch %s: %s, %d completed, %d failed", run.id, status, done["completed"], done["failed"], extra=fields)


async def _finalizing(run: Run, status: BatchStatus) -> BatchRow | None:
    if status != BatchStatus.COMPLETED or run.row.status == BatchStatus.FINALIZING:
        return None
    return await asyncio.to_thread(
        batches.transition, db=run.db, batch_id=run.id, to=BatchStatus.FINALIZING, lease=run.lease
    )


async def _commit_then_delete(run: Run, wanted: BatchStatus, commit: Move) -> BatchStatus:
    """A stop that comes while the batch ends waits for the commit, and for the deletes after it."""
    status = await _settle(run, wanted, commit)
    await _delete_all(run.storage, run.run_files)
    return status


async def _delete_all(storage: Storage, names: Sequence[str]) -> None:
    await storage.delete_all(names)


async def _unstoppable(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end even if the run is cancelled meanwhile (a stop): after the batch has ended, its run
    files are a few deletes (requests, on an object store) from gone; left, they would wait for the next start."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


async def _result_file(run: Run, appender: ResultAppender, kind: str) -> FileRow | None:
    if appender.lines == 0:
        return None
    row, storage = run.row, run.storage
    file_id = new_id("file-")
    await storage.store_part(appender.path, file_id)
    created = clock.now()
    ttl = row.output_expires_after_seconds or run.settings.output_file_ttl_seconds
    return FileRow(
        id=file_id,
        created_ns=clock.now_ns(),
        created_at=created,
        expires_at=created + ttl,
        bytes=appender.bytes,  # closed: the whole part, as stored
        filename=f"{row.id}_{kind}.jsonl",
        purpose=files.OUTPUT_PURPOSE,
        batch_id=row.id,
        owner=row.owner if row.parent_id is None else files.SHARD_OWNER,
    )


async def _end_from_checkpoint(
    run: Run, wanted: BatchStatus, errors: Sequence[BatchError], *, fill_unfinished: bool = True
) -> None:
    """End the batch as `wanted` (as `cancel_wins` says) with the results its checkpoint counts. Unless the disk is
    full (or not `fill_unfinished`), the lines that never ran get their error line, as at any cancel or expiry. The
    part files are the run's own, begun from the checkpoint's."""
    stored = await run.stored()
    if stored.status in TERMINAL:
        return
    run.row = stored
    status = cancel_wins(stored.status, wanted)
    if run.index is None:
        with contextlib.suppress(OSError, ValueError):  # none kept, or unreadable: no line is filled in
            run.index = await run.stored_index()
    sink = await run.sink_at_checkpoint(stored)
    try:
        if fill_unfinished and run.index is not None and status in (BatchStatus.CANCELLED, BatchStatus.EXPIRED):
            sink = await _with_unfinished(run, run.index, sink, status)
        await _end_with_results(run, sink, status, timeline={}, errors=errors)
    except BaseException:
        await sink.abandon()  # its files closed now: the next try opens them again, cut back to the checkpoint
        raise
    log.error("batch %s: ended from its last checkpoint as %s", run.id, status)


async def _with_unfinished(run: Run, index: InputIndex, sink: ResultSink, status: BatchStatus) -> ResultSink:
    """`sink` with the error lines of the requests that never ran written; with the disk full, a sink back at the
    checkpoint instead."""
    record_unfinished(sink, index, status)
    try:
        run.storage.check_room()
        await sink.checkpoint()
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        run.storage.reserve.release()
        await sink.abandon()
        return await run.sink_at_checkpoint(run.row)
    return sink


async def end_overdue(run: Run, *, quiet: bool) -> bool:
    """The watchdog's ending, which no line can stop: expired from the checkpoint, with an error line for each
    request that never ran; if that raises, failed (or cancelled) with only the checkpoint's results; if even that
    raises, with no result files, which takes nothing but a database write. False only when that write failed too;
    each failure is logged with its traceback unless `quiet` (a batch already tried)."""
    expired = partial(_end_from_checkpoint, run, BatchStatus.EXPIRED, ())
    failed = partial(_end_from_checkpoint, run, BatchStatus.FAILED, [RESULTS_NOT_WRITTEN], fill_unfinished=False)
    bare = partial(_end_without_results, run)
    endings = (("as expired", expired), ("with its checkpoint's results", failed), ("without result files", bare))
    for how, end in endings:
        try:
            await end()
        except Exception:
            if not quiet:
                log.exception("batch %s: the watchdog could not end it %s", run.id, how)
        else:
            return True
    return False


async def _end_without_results(run: Run) -> None:
    """End the batch failed (cancelled, if it was being cancelled) with no result files and no counts, saying so;
    its run files go if they can (the sweep at the next start takes what is left)."""
    stored = await run.stored()
    if stored.status in TERMINAL:
        return
    run.row = stored

    results: dict[str, Any] = {"output": None, "error": None, "progress": Progress(), "timeline": {}}
    commit = partial(_write_end, run, errors=[NO_RESULTS_WRITTEN], results=results)
    status = await _settle(run, BatchStatus.FAILED, commit)
    log.error("batch %s: ended %s without result files", run.id, status)
    try:
        await _unstoppable(_delete_all(run.storage, run.run_files))
    except Exception:
        log.warning("batch %s: its run files could not be deleted; the next start removes them", run.id)


def record_unfinished(sink: ResultSink, index: InputIndex, status: BatchStatus) -> None:
    """The lines that never ran get their error line, by custom_id from the index: the input is not read."""
    failpoints.ARMED.raise_here(failpoints.UNFINISHED_LINES_RAISE)
    if status == BatchStatus.CANCELLED:
        code, message = "batch_cancelled", CANCELLED_MESSAGE
    else:
        code, message = "batch_expired", EXPIRED_MESSAGE
    for position, custom_id in enumerate(index.custom_ids):
        if position not in sink.done:
            sink.record(position, error_outcome(custom_id, code, message))
