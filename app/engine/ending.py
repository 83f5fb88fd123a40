"""How a batch ends: its result parts become File objects in the transaction that makes it final.

A run ends its batch itself (`publish`). When it cannot, because the disk filled up under it, or it raised
something unexpected, or it outlived its completion window, `end_from_checkpoint` ends the batch with what its
last checkpoint holds: those lines are in its output and error files, nothing is lost that was counted, and the
batch stops holding a slot of its key's active-batch limit. `end_overdue`, the watchdog's, ends it even when
that raises: whatever its lines hold, a batch ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from app.core import clock, failpoints
from app.core.config import Settings
from app.core.disk import is_disk_full
from app.core.ids import new_id
from app.core.storage import ResultAppender, Storage
from app.domain import batches, files
from app.domain.batches import Progress
from app.domain.input_index import InputIndex
from app.domain.leases import Lease
from app.domain.lifecycle import TERMINAL, BatchStatus
from app.domain.models import BatchRow, FileRow
from app.domain.results import CANCELLED_MESSAGE, EXPIRED_MESSAGE, error_outcome, index_name, part_names, run_files
from app.domain.schemas import BatchError
from app.engine.parts import ResultSink

log = logging.getLogger("vbatch.runner")

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


async def publish(
    *,
    db: Engine,
    storage: Storage,
    settings: Settings,
    row: BatchRow,
    sink: ResultSink,
    status: BatchStatus,
    timeline: dict[str, float],
    series: Sequence[Sequence[float]] = (),
    errors: Sequence[BatchError] = (),
    lease: Lease | None = None,
) -> None:
    """Close the sink, give each non-empty part a File row, end the batch with them (under `lease`, if it still
    holds), then drop its run files."""
    await sink.close()
    failpoints.ARMED.raise_here(failpoints.PUBLISH_RAISES)
    output = await _result_file(storage, settings, row, sink.output, "output")
    error = await _result_file(storage, settings, row, sink.errors, "error")
    failpoints.ARMED.crash_here(failpoints.RESULTS_LINKED)
    commit = partial(
        batches.publish,
        db=db,
        batch_id=row.id,
        to=status,
        output=output,
        error=error,
        progress=sink.progress,
        timeline=timeline,
        series=series,
        errors=errors,
        lease=lease,
    )
    await _unstoppable(_commit_then_delete(commit, storage, run_files(row.id, row.lease_token)))
    done = {"completed": sink.progress.completed, "failed": sink.progress.failed}
    fields = {"batch_id": row.id, "event": f"batch.{status}", **done}
    log.info("batch %s: %s, %d completed, %d failed", row.id, status, done["completed"], done["failed"], extra=fields)


async def _commit_then_delete(commit: Callable[[], object], storage: Storage, names: Sequence[str]) -> None:
    """A stop that comes while the batch ends waits for the commit, and for the deletes after it."""
    await asyncio.to_thread(commit)
    await _delete_all(storage, names)


async def _delete_all(storage: Storage, names: Sequence[str]) -> None:
    for name in names:
        await storage.delete(name)


async def _unstoppable(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` to its end even if the run is cancelled meanwhile (a stop): after the batch has ended, its run
    files are a few deletes (requests, on an object store) from gone; left, they would wait for the next start."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


async def _result_file(
    storage: Storage, settings: Settings, row: BatchRow, appender: ResultAppender, kind: str
) -> FileRow | None:
    if appender.lines == 0:
        return None
    file_id = new_id("file-")
    await storage.publish(appender.path, file_id)
    created = clock.now()
    ttl = row.output_expires_after_seconds or settings.output_file_ttl_seconds
    return FileRow(
        id=file_id,
        created_ns=clock.now_ns(),
        created_at=created,
        expires_at=created + ttl,
        bytes=await storage.size(file_id),
        filename=f"{row.id}_{kind}.jsonl",
        purpose=files.OUTPUT_PURPOSE,
        batch_id=row.id,
        owner=row.owner if row.parent_id is None else files.SHARD_OWNER,
    )


async def end_from_checkpoint(
    *,
    db: Engine,
    storage: Storage,
    settings: Settings,
    batch_id: str,
    status: BatchStatus,
    errors: Sequence[BatchError],
    lease: Lease | None = None,
    fill_unfinished: bool = True,
) -> None:
    """End the batch as `status` (cancelled if it was being cancelled) with the results its checkpoint counts.
    Unless the disk is full (or not `fill_unfinished`), the lines that never ran get their error line, as at any
    cancel or expiry. Under `lease`, the part files are that lease's, begun from the checkpoint's."""
    row = await asyncio.to_thread(batches.get, db=db, batch_id=batch_id, owner=None)
    if row.status in TERMINAL:
        return
    if row.status == BatchStatus.CANCELLING:
        status = BatchStatus.CANCELLED
    elif row.status == BatchStatus.FINALIZING and status != BatchStatus.FAILED:
        status = BatchStatus.COMPLETED  # every line had its result already
    index = await _index(storage, batch_id)
    sink = await _sink_at_checkpoint(storage, row, index, lease)
    try:
        if fill_unfinished and index is not None and status in (BatchStatus.CANCELLED, BatchStatus.EXPIRED):
            sink = await _with_unfinished(storage, row, index, lease, sink, status)
        await publish(
            db=db,
            storage=storage,
            settings=settings,
            row=row,
            sink=sink,
            status=status,
            timeline={},
            errors=errors,
            lease=lease,
        )
    except BaseException:
        await sink.abandon()  # its files closed now: the next try opens them again, cut back to the checkpoint
        raise
    log.error("batch %s: ended from its last checkpoint as %s", batch_id, status)


async def _with_unfinished(
    storage: Storage, row: BatchRow, index: InputIndex, lease: Lease | None, sink: ResultSink, status: BatchStatus
) -> ResultSink:
    """`sink` with the error lines of the requests that never ran written; with the disk full, a sink back at the
    checkpoint instead."""
    record_unfinished(sink, index, status)
    try:
        storage.check_room()
        await sink.checkpoint()
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        storage.reserve.release()
        await sink.abandon()
        return await _sink_at_checkpoint(storage, row, index, lease)
    return sink


async def end_overdue(
    *, db: Engine, storage: Storage, settings: Settings, batch_id: str, lease: Lease | None, quiet: bool
) -> bool:
    """The watchdog's ending, which no line can stop: expired from the checkpoint, with an error line for each
    request that never ran; if that raises, failed (or cancelled) with only the checkpoint's results; if even that
    raises, with no result files, which takes nothing but a database write. False only when that write failed too;
    each failure is logged with its traceback unless `quiet` (a batch already tried)."""
    common: dict[str, Any] = {"db": db, "storage": storage, "settings": settings, "batch_id": batch_id, "lease": lease}
    expired = partial(end_from_checkpoint, **common, status=BatchStatus.EXPIRED, errors=())
    failed = partial(
        end_from_checkpoint, **common, status=BatchStatus.FAILED, errors=[RESULTS_NOT_WRITTEN], fill_unfinished=False
    )
    bare = partial(end_without_results, db=db, storage=storage, batch_id=batch_id, lease=lease)
    endings = (("as expired", expired), ("with its checkpoint's results", failed), ("without result files", bare))
    for how, end in endings:
        try:
            await end()
        except Exception:
            if not quiet:
                log.exception("batch %s: the watchdog could not end it %s", batch_id, how)
        else:
            return True
    return False


async def end_without_results(*, db: Engine, storage: Storage, batch_id: str, lease: Lease | None) -> None:
    """End the batch failed (cancelled, if it was being cancelled) with no result files and no counts, saying so;
    its run files go if they can (the sweep at the next start takes what is left)."""
    row = await asyncio.to_thread(batches.get, db=db, batch_id=batch_id, owner=None)
    if row.status in TERMINAL:
        return
    status = BatchStatus.CANCELLED if row.status == BatchStatus.CANCELLING else BatchStatus.FAILED
    await asyncio.to_thread(
        batches.publish,
        db=db,
        batch_id=batch_id,
        to=status,
        output=None,
        error=None,
        progress=Progress(),
        timeline={},
        errors=[NO_RESULTS_WRITTEN],
        lease=lease,
    )
    log.error("batch %s: ended %s without result files", batch_id, status)
    try:
        await _unstoppable(_delete_all(storage, run_files(row.id, row.lease_token)))
    except Exception:
        log.warning("batch %s: its run files could not be deleted; the next start removes them", batch_id)


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


async def _index(storage: Storage, batch_id: str) -> InputIndex | None:
    try:
        return InputIndex.from_bytes(await storage.read_bytes(index_name(batch_id)))
    except (OSError, ValueError):
        return None


def own_parts(storage: Storage, row: BatchRow, lease: Lease | None) -> tuple[Path, Path]:
    """The output and error part files a run writes: its lease's (or, run without one, the last checkpoint's)."""
    token = lease.token if lease is not None else row.parts_token
    output, error = (storage.path(name) for name in part_names(row.id, token))
    return output, error


async def begin_parts(
    storage: Storage, row: BatchRow, sink: ResultSink, position_of: Callable[[], dict[str, int]]
) -> None:
    """Start a run's parts from what the last checkpoint counts in the parts it was taken in (`Storage.begin_parts`),
    and open them, cut back to it, their lines counted."""
    previous = part_names(row.id, row.parts_token)
    own = (sink.output.path, sink.errors.path)
    sink.ship = await storage.begin_parts(previous, (row.output_bytes_done, row.error_bytes_done), own)
    await sink.open(output_bytes=row.output_bytes_done, error_bytes=row.error_bytes_done, position_of=position_of)


async def _sink_at_checkpoint(
    storage: Storage, row: BatchRow, index: InputIndex | None, lease: Lease | None
) -> ResultSink:
    """The run's parts, begun from the checkpoint's, cut back to it and open again, their lines counted."""
    sink = ResultSink(*own_parts(storage, row, lease))
    # Without an index no line is filled in, so which position a custom_id had does not matter, only the counts.
    await begin_parts(storage, row, sink, index.position_of if index is not None else lambda: defaultdict(int))
    return sink
