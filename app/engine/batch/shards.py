"""A large batch that several workers share: cut into shards when it is validated, joined again when they end.

A worker that validates a batch of more than `shard_lines` lines (beside other workers: `vbatch serve` never cuts)
cuts its lines, in planned order and on adapter and shared-prefix group boundaries, into shards: hidden batches with
their own input, index, leases, checkpoints and takeovers, claimed like any batch by whichever worker has room.
They are created in the transaction that starts the parent. The parent's run waits under its own lease: it keeps
its counts as the sum of its shards', passes a cancel on to them, and once every shard has ended joins their result
files in shard order into its own and ends with them; the shards and their files go after that commit. A shard's
end sends no webhook and lists nowhere: the parent's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from app.core import clock
from app.core.ids import new_id
from app.domain import batches
from app.domain.batches import Progress
from app.domain.input_index import InputIndex
from app.domain.lifecycle import TERMINAL, BatchStatus, InvalidTransition
from app.domain.models import BatchRow
from app.domain.results import index_name, input_name
from app.domain.schemas import BatchError, BatchErrors
from app.engine.batch.context import Context
from app.engine.batch.ending import Ran, shards_ending
from app.engine.batch.ordering import Group, plan
from app.engine.batch.parts import ResultSink
from app.engine.batch.run import Run

log = logging.getLogger("vbatch.runner")


def cut(index: InputIndex, shard_lines: int) -> list[list[int]]:
    """Positions in planned order, in shards of at least `shard_lines` (the last may be smaller); a shared-prefix
    group stays whole, on one worker, where its prefix is cached, and so do an adapter's lines unless they are more
    than a shard's: each worker then loads few adapters, and runs each one's lines together."""
    shards: list[list[int]] = [[]]
    for piece in _pieces(plan(index), shard_lines):
        if len(shards[-1]) >= shard_lines:
            shards.append([])
        shards[-1].extend(piece)
    return shards


def _pieces(groups: list[Group], shard_lines: int) -> Iterator[Sequence[int]]:
    """The planned lines in pieces that no shard boundary cuts: an adapter's lines whole, if no more than a shard's;
    else each shared-prefix group whole, and lines that share no prefix in pieces of a shard's size."""
    for _, same_adapter in itertools.groupby(groups, key=lambda group: group.adapter):
        adapter_groups = list(same_adapter)
        if sum(len(group.positions) for group in adapter_groups) <= shard_lines:
            yield [position for group in adapter_groups for position in group.positions]
            continue
        for group in adapter_groups:
            if group.shared_prefix:
                yield group.positions
            else:
                yield from (group.positions[i : i + shard_lines] for i in range(0, len(group.positions), shard_lines))


async def make_shards(
    ctx: Context, *, parent: BatchRow, source_name: str, index: InputIndex, model: str | None
) -> list[BatchRow]:
    """The shard rows to start `parent` with, cut from its input (stored as `source_name`), their inputs and indexes
    stored (under the names each shard's own run will use); none if it is not large enough to cut (or this service
    does not cut)."""
    positions = cut(index, ctx.shard_lines) if ctx.shard_lines and len(index) > ctx.shard_lines else []
    if len(positions) < 2:
        return []
    source = await ctx.storage.local_path(source_name)
    shards = []
    for number, shard in enumerate(positions):
        data, shard_index = await asyncio.to_thread(_extract, source, index, shard)
        shard_row = _shard_row(parent, number, total=len(shard), model=model)
        await ctx.storage.save_bytes(input_name(shard_row.id), data)
        await ctx.storage.save_bytes(index_name(shard_row.id), shard_index.to_bytes())
        shards.append(shard_row)
    log.info("batch %s: %d requests in %d shards", parent.id, len(index), len(shards))
    return shards


def _extract(source: Path, index: InputIndex, positions: list[int]) -> tuple[bytes, InputIndex]:
    """A shard's input (its lines, as the client sent them) and its index, with each line's number in the parent's
    file, so that errors name the line the client knows."""
    lines, shard = [], InputIndex()
    offset = 0
    with source.open("rb") as src:
        for position in positions:
            src.seek(index.offsets[position])
            line = src.read(index.lengths[position])
            lines.append(line + b"\n")
            shard.add_from(index, position, offset=offset)
            offset += len(line) + 1
    return b"".join(lines), shard


def _shard_row(parent: BatchRow, number: int, *, total: int, model: str | None) -> BatchRow:
    now = clock.now()
    return BatchRow(
        id=new_id("batch_"),
        created_ns=parent.created_ns + number + 1,  # claimed after its parent, in shard order
        endpoint=parent.endpoint,
        input_file_id=parent.input_file_id,
        completion_window=parent.completion_window,
        status=BatchStatus.IN_PROGRESS,
        owner=parent.owner,  # the round robin over keys counts it as its parent's
        turn=parent.turn,  # claimed in its parent's turn, in shard order
        model=model,
        output_expires_after_seconds=parent.output_expires_after_seconds,
        created_at=parent.created_at,
        in_progress_at=now,
        expires_at=parent.expires_at,
        total=total,
        parent_id=parent.id,
        shard=number,
    )


async def run_parent(ctx: Context, run: Run) -> Ran:
    """Wait for the shards, keeping the parent's counts and passing a cancel on; then their results joined, to end
    the parent with (its shards go after that commit)."""
    while (ended := await asyncio.to_thread(_look_at_shards, ctx, run)) is None:
        await asyncio.sleep(ctx.settings.checkpoint_seconds)
    run.row, shards, progress = ended
    return await _join(ctx, run.new_sink(), shards, progress)


def _look_at_shards(ctx: Context, run: Run) -> tuple[BatchRow, list[BatchRow], Progress] | None:
    """Pass a cancel on and keep the parent's counts; once every shard has ended, the parent, its shards and their
    counts (None before)."""
    parent = run.stored_now()
    shards = batches.shards_of(db=ctx.db, batch_id=run.id)
    if parent.status == BatchStatus.CANCELLING:
        _cancel(ctx, shards)
    progress = _sum(shards)
    if all(shard.status in TERMINAL for shard in shards):
        return parent, shards, progress
    batches.save_checkpoint(
        db=ctx.db, batch_id=run.id, progress=progress, output_bytes=0, error_bytes=0, lease=run.lease
    )
    return None


def _cancel(ctx: Context, shards: list[BatchRow]) -> None:
    for shard in shards:
        if shard.status not in TERMINAL and shard.status not in (BatchStatus.CANCELLING, BatchStatus.FINALIZING):
            with contextlib.suppress(InvalidTransition):  # it moved on meanwhile: it ends with what it has
                batches.transition(db=ctx.db, batch_id=shard.id, to=BatchStatus.CANCELLING)


def _sum(shards: list[BatchRow]) -> Progress:
    total = Progress()
    for shard in shards:
        total = total.plus(batches.progress_of(shard))
    return total


async def _join(ctx: Context, sink: ResultSink, shards: list[BatchRow], progress: Progress) -> Ran:
    """The shards' result files joined in shard order into `sink`, the parent's."""
    await sink.open(output_bytes=0, error_bytes=0, position_of=dict)
    for shard in shards:
        for file_id, appender in ((shard.output_file_id, sink.output), (shard.error_file_id, sink.errors)):
            if file_id is not None:
                async for chunk in ctx.storage.read_chunks(file_id):
                    appender.add_lines(chunk)
                await appender.flush()
    sink.progress = replace(progress)
    return Ran(sink, shards_ending(shards), errors=_errors(shards), shards=shards)


def _errors(shards: list[BatchRow]) -> list[BatchError]:
    found: list[BatchError] = []
    for shard in shards:
        if shard.errors_json:
            found.extend(BatchErrors.model_validate_json(shard.errors_json).data)
    return found
