"""Where results go as they finish: one sink for the service and for `vbatch run`.

A sink appends output and error lines to two files and counts them. A checkpoint fsyncs both and hands their
lengths, with the counts and usage they hold, to whoever keeps them (the service commits them to the database in
one transaction). After a crash the files are cut back to those lengths and re-read: the lines they hold are done
and never sent to the engine again; anything after the checkpoint runs again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from app.core.storage import ResultAppender, ShipParts
from app.domain.batches import Progress
from app.domain.results import Outcome, add_usage, line_for, stopped_at_cap

log = logging.getLogger("vbatch.runner")


@dataclass(frozen=True)
class Checkpoint:
    progress: Progress
    output_bytes: int
    error_bytes: int


# Makes a checkpoint durable beyond the files (a database commit); runs on a worker thread.
SaveCheckpoint = Callable[[Checkpoint], None]


class ResultSink:
    """`observe` sees every result recorded (not those restored from a checkpoint): the service's metrics."""

    def __init__(self, output: Path, errors: Path, observe: Callable[[Outcome], None] | None = None) -> None:
        self.observe = observe
        self.output = ResultAppender(output)
        self.errors = ResultAppender(errors)
        self.progress = Progress()
        self.done: set[int] = set()  # positions in the input index
        # Set by whoever began the part files (`Storage.begin_parts`) when they must reach a store beyond this disk.
        self.ship: ShipParts | None = None
        self._checkpointing = asyncio.Lock()

    async def open(
        self, *, output_bytes: int | None, error_bytes: int | None, position_of: Callable[[], dict[str, int]]
    ) -> None:
        """Cut each file back to its checkpointed length (None: to its last whole line), take the lines there as
        done, and open for appending. `position_of` maps custom_ids to positions; it is called only if there are
        lines to take."""
        await asyncio.to_thread(self._restore, output_bytes, error_bytes, position_of)
        await self.output.open()
        await self.errors.open()

    def _restore(
        self, output_bytes: int | None, error_bytes: int | None, position_of: Callable[[], dict[str, int]]
    ) -> None:
        positions: dict[str, int] | None = None
        for appender, length, succeeded in ((self.output, output_bytes, True), (self.errors, error_bytes, False)):
            cut_back(appender.path, length)
            for record in _records(appender.path):
                positions = positions if positions is not None else position_of()
                self.done.add(positions[record["custom_id"]])
                appender.lines += 1
                if succeeded:
                    self.progress.completed += 1
                else:
                    self.progress.failed += 1
                body = (record.get("response") or {}).get("body") or {}
                add_usage(self.progress, body.get("usage") or {}, cut=stopped_at_cap(body))

    def record(self, position: int, outcome: Outcome) -> None:
        self.done.add(position)
        if outcome.succeeded:
            self.output.add(line_for(outcome))
            self.progress.completed += 1
        else:
            self.errors.add(line_for(outcome))
            self.progress.failed += 1
        add_usage(self.progress, outcome.usage, cut=outcome.cut)
        if self.observe is not None:
            self.observe(outcome)

    async def checkpoint(self, save: SaveCheckpoint | None = None) -> None:
        """Shielded: a checkpoint cancelled between taking the buffers and writing them would lose those lines
        (the ticker that calls it is cancelled whenever the work ends). The next checkpoint or `close` waits for it."""
        going_on = asyncio.ensure_future(self._checkpoint(save))
        try:
            await asyncio.shield(going_on)
        except asyncio.CancelledError:
            # Cancelled, the shield no longer reads how the checkpoint ends: an error it ends with (its lease lost
            # at a stop) would be logged as a task exception never retrieved. The next checkpoint meets it again.
            going_on.add_done_callback(_ended_unawaited)
            raise

    async def _checkpoint(self, save: SaveCheckpoint | None) -> None:
        async with self._checkpointing:  # two checkpoints must not interleave their writes
            # Taken together, with no await between: the counts describe exactly the bytes about to be written.
            progress = replace(self.progress)
            output, errors = self.output.take(), self.errors.take()
            await self.output.write(output, durable=True)
            await self.errors.write(errors, durable=True)
            if self.ship is not None:
                await self.ship((self.output.bytes, output), (self.errors.bytes, errors))
            if save is not None:
                await asyncio.to_thread(save, Checkpoint(progress, self.output.bytes, self.errors.bytes))

    async def close(self) -> None:
        async with self._checkpointing:
            await self.output.close()
            await self.errors.close()

    async def abandon(self) -> None:
        """Close both files dropping what was not written (a full disk): the checkpoint is what counts."""
        await self.output.abandon()
        await self.errors.abandon()


def _ended_unawaited(checkpoint: asyncio.Future) -> None:
    if not checkpoint.cancelled() and (error := checkpoint.exception()) is not None:
        log.info("a checkpoint that went on after its caller stopped failed: %r", error)


def cut_back(path: Path, length: int | None) -> None:
    """Cut a result file back to its checkpointed length; with none, or if it is somehow shorter than its
    checkpoint, to its last whole line."""
    if not path.exists():
        return
    size = path.stat().st_size
    if length is not None and size >= length:
        if size > length:
            os.truncate(path, length)
        return
    if length is not None:
        log.error("%s is shorter (%d bytes) than its checkpoint (%d); keeping its whole lines", path.name, size, length)
    cut_torn_tail(path)


def cut_torn_tail(path: Path) -> None:
    """A crash mid-write can leave half a line at the end: cut the file back to its last newline."""
    with path.open("rb+") as part:
        size = part.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:
            step = min(65536, keep)
            part.seek(keep - step)
            newline = part.read(step).rfind(b"\n")
            if newline >= 0:
                keep = keep - step + newline + 1
                break
            keep -= step
        if keep != size:
            part.truncate(keep)
            os.fsync(part.fileno())


def _records(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with path.open("rb") as part:
        for line in part:
            yield json.loads(line)
