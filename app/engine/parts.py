"""A running batch's results: `<batch>.output.part` and `<batch>.error.part`, appended as lines finish.

A checkpoint fsyncs both files and commits, in one SQLite transaction, their lengths with the counts and usage
they hold. After a crash the files are cut back to those lengths and re-read: the lines they hold are done and
never sent to the engine again; anything after the checkpoint runs again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

from sqlalchemy.engine import Engine

from app import batches
from app.batches import Progress
from app.models import BatchRow
from app.results import Outcome, add_usage, line_for
from app.storage import Storage
from app.validation import request_lines

log = logging.getLogger("vbatch.runner")


def part_names(batch_id: str) -> tuple[str, str]:
    return f"{batch_id}.output.part", f"{batch_id}.error.part"


class PartFiles:
    def __init__(self, storage: Storage, row: BatchRow) -> None:
        output_name, error_name = part_names(row.id)
        self.output = storage.open_appender(output_name)
        self.errors = storage.open_appender(error_name)
        self.input_path = storage.path(row.input_file_id)
        self.row = row
        self.progress = Progress()
        self.done: set[int] = set()
        self._checkpointing = asyncio.Lock()

    async def open(self) -> None:
        """Cut back to the last checkpoint, take what is there as done, and open for appending."""
        await asyncio.to_thread(self._restore)
        await self.output.open()
        await self.errors.open()

    def _restore(self) -> None:
        cut_back(self.output.path, self.row.output_bytes_done)
        cut_back(self.errors.path, self.row.error_bytes_done)
        if not self.output.path.exists() and not self.errors.path.exists():
            return
        number_of = {request["custom_id"]: number for number, request in request_lines(self.input_path)}
        for appender, succeeded in ((self.output, True), (self.errors, False)):
            for record in _records(appender.path):
                self.done.add(number_of[record["custom_id"]])
                appender.lines += 1
                if succeeded:
                    self.progress.completed += 1
                else:
                    self.progress.failed += 1
                add_usage(self.progress, (record.get("response") or {}).get("body"))
        if self.done:
            log.info("batch %s: resuming, %d of %d lines already done", self.row.id, len(self.done), self.row.total)

    def record(self, number: int, outcome: Outcome) -> None:
        self.done.add(number)
        if outcome.succeeded:
            self.output.add(line_for(outcome))
            self.progress.completed += 1
        else:
            self.errors.add(line_for(outcome))
            self.progress.failed += 1
        add_usage(self.progress, outcome.body)

    async def checkpoint(self, db: Engine) -> None:
        """Shielded: a checkpoint cancelled between taking the buffers and writing them would lose those lines
        (the ticker that calls it is cancelled whenever the work ends). The next checkpoint or `close` waits for it."""
        await asyncio.shield(self._checkpoint(db))

    async def _checkpoint(self, db: Engine) -> None:
        async with self._checkpointing:  # two checkpoints must not interleave their writes
            # Taken together, with no await between: the counts describe exactly the bytes about to be written.
            progress = replace(self.progress)
            output, errors = self.output.take(), self.errors.take()
            await self.output.write(output, durable=True)
            await self.errors.write(errors, durable=True)
            await asyncio.to_thread(
                batches.save_checkpoint,
                db=db,
                batch_id=self.row.id,
                progress=progress,
                output_bytes=self.output.bytes,
                error_bytes=self.errors.bytes,
            )

    async def close(self) -> None:
        async with self._checkpointing:
            await self.output.close()
            await self.errors.close()


def cut_back(path: Path, length: int) -> None:
    """Cut a part file back to its checkpointed length; if it is somehow shorter, to its last whole line."""
    if not path.exists():
        return
    size = path.stat().st_size
    if size > length:
        os.truncate(path, length)
    elif size < length:
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


def _records(path: Path):
    if not path.exists():
        return
    with path.open("rb") as part:
        for line in part:
            yield json.loads(line)
