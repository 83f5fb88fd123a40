"""A batch's input on its way in: validated once, indexed, and given the batch's own name for its bytes.

The story's one call here is `take_in`: a new batch's input validated (and, when large, cut into shards), or the
index of a batch taken up again loaded. The input's one full read happens here; from then on the batch reads its
lines by offset from the index (`app.domain.input_index`), and its own hard link to the bytes keeps them whatever
happens to the input's file object. A cancel may come at any point of it. What stops a batch here (`Refused`,
`InputGone`, `CancelledFirst`) is told to the run's one exit, `ending.end`, which ends it.
"""

from __future__ import annotations

import asyncio
import logging

from app.core.disk import is_disk_full
from app.domain import batches, files
from app.domain.adapters import parents
from app.domain.input_index import InputIndex
from app.domain.lifecycle import BatchStatus, InvalidTransition
from app.domain.validation import Limits, Report, validate_file
from app.engine.batch.context import Context
from app.engine.batch.ending import CancelledFirst, InputGone, Refused
from app.engine.batch.run import Run
from app.engine.batch.shards import make_shards

log = logging.getLogger("vbatch.runner")


async def take_in(ctx: Context, run: Run) -> Refused | InputGone | CancelledFirst | None:
    """The batch's input ready for its run: a new batch's validated (`validate`), the index of one taken up again
    loaded (`load_index`). None when the run goes on, with `run.index` set if it runs lines of its own; else why
    not, for `ending.end` to end it."""
    if run.row.status == BatchStatus.VALIDATING:
        return await validate(ctx, run)
    if run.runs_own_lines and run.index is None:
        index = await load_index(ctx, run)
        if isinstance(index, InputGone):
            return index
        run.index = index
    return None


async def validate(ctx: Context, run: Run) -> Refused | InputGone | CancelledFirst | None:
    """The input's one full read: every line checked and, if all are good, indexed; the index is kept beside the
    batch's results before the batch starts, so a restart never reads the input whole again. None once the batch
    has started (`run.index` set if it runs lines of its own); else why it did not, for `ending.end` to end it
    (where a cancel that came at any point of it wins)."""
    row = run.row
    try:
        source = await asyncio.to_thread(files.get, db=ctx.db, file_id=row.input_file_id, owner=None)
        report = await _read_input(ctx, run.input_name, row.endpoint, source_id=source.id)
    except Exception as exc:  # the input file vanished (deleted) or cannot be read
        if is_disk_full(exc):
            raise
        log.warning("batch %s: input file unreadable: %s", row.id, type(exc).__name__)
        return InputGone()
    if not report.ok:
        fields = {"batch_id": row.id, "event": "batch.validation_failed", "errors": report.error_count}
        log.info("batch %s: failed validation with %d errors", row.id, report.error_count, extra=fields)
        for error in report.errors:
            ctx.metrics.validation_failures.labels(error.code or "unknown").inc()
        return Refused(report.errors)
    await ctx.storage.save_bytes(run.index_name, report.index.to_bytes())
    model = report.model or (ctx.served_models[0] if ctx.served_models else None)
    fields = {"batch_id": row.id, "event": "batch.validated", "requests": report.total}
    log.info("batch %s: %d requests validated", row.id, report.total, extra=fields)
    shards = await make_shards(ctx, parent=row, source_name=run.input_name, index=report.index, model=model)
    try:
        run.row = await asyncio.to_thread(
            batches.start, db=ctx.db, batch_id=row.id, total=report.total, model=model, lease=run.lease, shards=shards
        )
    except InvalidTransition:  # a cancel came first
        return CancelledFirst()
    ctx.announce(report.found_adapters)
    # A parent of shards runs none of its lines itself (`shards.run_parent`).
    run.index = None if shards else report.index
    return None


async def load_index(ctx: Context, run: Run) -> InputIndex | InputGone:
    """The index validation kept. A batch that began before vbatch kept one (and its own name for the input) gets
    both now, once; or, its input gone since, it ends rather than wait."""
    try:
        return await run.stored_index()
    except FileNotFoundError:
        pass
    try:
        linked = await asyncio.to_thread(ctx.storage.exists, run.input_name)
        source_id = None if linked else run.row.input_file_id
        report = await _read_input(ctx, run.input_name, run.row.endpoint, source_id=source_id)
        await ctx.storage.save_bytes(run.index_name, report.index.to_bytes())
    except FileNotFoundError:
        log.error("batch %s: its input file %s is gone; the batch ends", run.id, run.row.input_file_id)
        return InputGone()
    return report.index


async def _read_input(ctx: Context, name: str, endpoint: str, *, source_id: str | None) -> Report:
    """Validate (and index) the batch's own name for its input, first linking it to `source_id` if given."""
    if source_id is not None:
        await ctx.storage.copy(source_id, name)
    path = await ctx.storage.local_path(name)
    limits = Limits.from_settings(
        ctx.settings,
        endpoint=endpoint,
        served_models=ctx.served_models,
        parents=parents(ctx.adapters),
        find_adapter=ctx.find_adapter,
    )
    return await asyncio.to_thread(validate_file, path, limits)
