"""A batch's input on its way in: validated once, indexed, and given the batch's own name for its bytes.

The input's one full read happens here; from then on the batch reads its lines by offset from the index
(`app.domain.input_index`), and its own hard link to the bytes keeps them whatever happens to the input's file
object. A cancel may come at any point of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from app.core.disk import is_disk_full
from app.domain import batches, files
from app.domain.input_index import InputIndex
from app.domain.lifecycle import BatchStatus, InvalidTransition
from app.domain.models import BatchRow
from app.domain.results import index_name, input_name
from app.domain.schemas import BatchError
from app.domain.validation import Limits, Report, validate_file
from app.engine.context import Context
from app.engine.shards import make_shards

log = logging.getLogger("vbatch.runner")


def _limits(ctx: Context, row: BatchRow) -> Limits:
    return Limits.from_settings(ctx.settings, endpoint=row.endpoint, served_models=ctx.served_models)


async def validate(ctx: Context, row: BatchRow) -> tuple[BatchRow, InputIndex | None]:
    """The input's one full read: every line checked and, if all are good, indexed; the index is kept beside the
    batch's results before the batch starts, so a restart never reads the input whole again. A cancel may come at
    any point of it: the batch is then left as the cancel made it."""
    lease = ctx.leases.get(row.id)
    try:
        source = await asyncio.to_thread(files.get, db=ctx.db, file_id=row.input_file_id, owner=None)
        report = await _read_input(ctx, row, source.id)
    except Exception as exc:  # the input file vanished (deleted) or cannot be read
        if is_disk_full(exc):
            raise
        log.warning("batch %s: input file unreadable: %s", row.id, type(exc).__name__)
        failed = await asyncio.to_thread(
            _unless_cancelled,
            ctx,
            row.id,
            lambda: batches.fail(db=ctx.db, batch_id=row.id, errors=[_input_gone(row)], lease=lease),
        )
        return failed, None
    if not report.ok:
        fields = {"batch_id": row.id, "event": "batch.validation_failed", "errors": report.error_count}
        log.info("batch %s: failed validation with %d errors", row.id, report.error_count, extra=fields)
        for error in report.errors:
            ctx.metrics.validation_failures.labels(error.code or "unknown").inc()
        return await asyncio.to_thread(
            _unless_cancelled,
            ctx,
            row.id,
            lambda: batches.fail(db=ctx.db, batch_id=row.id, errors=report.errors, lease=lease),
        ), None
    await ctx.storage.save_bytes(index_name(row.id), report.index.to_bytes())
    model = report.model or (ctx.served_models[0] if ctx.served_models else None)
    fields = {"batch_id": row.id, "event": "batch.validated", "requests": report.total}
    log.info("batch %s: %d requests validated", row.id, report.total, extra=fields)
    shards = await make_shards(ctx, row, report.index, model)
    started = await asyncio.to_thread(
        _unless_cancelled,
        ctx,
        row.id,
        lambda: batches.start(db=ctx.db, batch_id=row.id, total=report.total, model=model, lease=lease, shards=shards),
    )
    # A parent of shards runs none of its lines itself (`shards.run_parent`).
    return started, report.index if started.status == BatchStatus.IN_PROGRESS and not shards else None


def _unless_cancelled(ctx: Context, batch_id: str, move: Callable[[], BatchRow]) -> BatchRow:
    """The batch after `move`; or, if a cancel moved it first, as the cancel left it."""
    try:
        return move()
    except InvalidTransition:
        return batches.get(db=ctx.db, batch_id=batch_id, owner=None)


def _input_gone(row: BatchRow) -> BatchError:
    return BatchError(code="file_not_found", message=f"The input file {row.input_file_id} cannot be read.")


async def load_index(ctx: Context, row: BatchRow) -> InputIndex:
    """The index validation kept. A batch that began before vbatch kept one (and its own name for the input) gets
    both now, once; FileNotFoundError if its input is gone."""
    try:
        return InputIndex.from_bytes(await ctx.storage.read_bytes(index_name(row.id)))
    except FileNotFoundError:
        linked = await asyncio.to_thread(ctx.storage.exists, input_name(row.id))
        report = await _read_input(ctx, row, source_id=None if linked else row.input_file_id)
        await ctx.storage.save_bytes(index_name(row.id), report.index.to_bytes())
        return report.index


async def _read_input(ctx: Context, row: BatchRow, source_id: str | None) -> Report:
    """Validate (and index) the batch's own name for its input, first linking it to `source_id` if given."""
    if source_id is not None:
        await ctx.storage.copy(source_id, input_name(row.id))
    path = await ctx.storage.local_path(input_name(row.id))
    return await asyncio.to_thread(validate_file, path, _limits(ctx, row))


def end_without_input(ctx: Context, row: BatchRow) -> None:
    """A batch that began before vbatch kept its own input, whose input has since gone: it ends rather than wait."""
    log.error("batch %s: its input file %s is gone; the batch ends", row.id, row.input_file_id)
    lease = ctx.leases.get(row.id)
    if row.status == BatchStatus.CANCELLING:
        batches.transition(db=ctx.db, batch_id=row.id, to=BatchStatus.CANCELLED, lease=lease)
    else:
        batches.fail(db=ctx.db, batch_id=row.id, errors=[_input_gone(row)], lease=lease)
