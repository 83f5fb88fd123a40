"""`GET /v1/batches/{id}/partial_output` (a vbatch extension): the result lines a batch has so far.

While the batch runs, its part file up to the last checkpoint (lines that will not change), or for a batch cut
into shards its shards' lines so far, in shard order; once it ends, its published output or error file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal, cast

from sqlalchemy.engine import Engine

from app.core.storage import Storage, no_bytes
from app.domain import batches
from app.domain.errors import NotFound
from app.domain.lifecycle import TERMINAL
from app.domain.models import BatchRow
from app.domain.results import part_names

Kind = Literal["output", "error"]


class ResultFileGone(NotFound):
    """An ended batch's result file was deleted (or expired): its lines cannot be shown."""

    def __init__(self, file_id: str) -> None:
        super().__init__("File", file_id, param="batch_id")


async def open_partial(
    *, db: Engine, storage: Storage, batch_id: str, kind: Kind, owner: str
) -> tuple[AsyncIterator[bytes], int]:
    # Twice: a batch can finish between reading its row and opening its part file, which it then removes.
    for _ in range(2):
        rows = await asyncio.to_thread(_rows_with_lines, db=db, batch_id=batch_id, kind=kind, owner=owner)
        opened = [await _open(storage, each, kind) for each in rows]
        if all(each is not None for each in opened):
            return _joined([each for each in opened if each is not None])
    return no_bytes(), 0


def _rows_with_lines(*, db: Engine, batch_id: str, kind: Kind, owner: str) -> list[BatchRow]:
    row = batches.get(db=db, batch_id=batch_id, owner=owner)
    if row.shards and _file_of(row, kind) is None and row.status not in TERMINAL:
        return batches.shards_of(db=db, batch_id=row.id)  # a parent has no lines of its own until it joins them
    return [row]


def _file_of(row: BatchRow, kind: Kind) -> str | None:
    return row.output_file_id if kind == "output" else row.error_file_id


async def _open(storage: Storage, row: BatchRow, kind: Kind) -> tuple[AsyncIterator[bytes], int] | None:
    """None: the batch ended meanwhile (its part file is gone)."""
    file_id = _file_of(row, kind)
    if file_id is not None:
        opened = await storage.open_prefix(file_id)
        if opened is None:  # deleted, or expired: an empty answer would say the batch had no such lines
            raise ResultFileGone(file_id)
        return opened
    if row.status in TERMINAL:
        return no_bytes(), 0
    part = part_names(row.id, row.parts_token)[0 if kind == "output" else 1]
    done = row.output_bytes_done if kind == "output" else row.error_bytes_done
    opened = await storage.open_part(part, done)
    return (no_bytes(), 0) if opened is None and done == 0 else opened


def _joined(streams: list[tuple[AsyncIterator[bytes], int]]) -> tuple[AsyncIterator[bytes], int]:
    if len(streams) == 1:
        return streams[0]

    async def chunks() -> AsyncIterator[bytes]:
        try:
            for stream, _ in streams:
                async for chunk in stream:
                    yield chunk
        finally:  # a reader that stops early (`first_lines`) closes this stream, and with it each file it opened
            for stream, _ in streams:
                await cast(AsyncGenerator[bytes, None], stream).aclose()

    return chunks(), sum(length for _, length in streams)


async def first_lines(
    *, db: Engine, storage: Storage, batch_id: str, kind: Kind, owner: str, count: int, max_bytes: int = 256 * 1024
) -> list[dict]:
    """The first `count` result lines written so far (those that fit in `max_bytes`), parsed; none when the file
    that held them was deleted."""
    try:
        chunks, _ = await open_partial(db=db, storage=storage, batch_id=batch_id, kind=kind, owner=owner)
    except ResultFileGone:
        return []
    head = bytearray()
    async for chunk in chunks:
        head.extend(chunk)
        if head.count(b"\n") >= count or len(head) >= max_bytes:
            break
    await cast(AsyncGenerator[bytes, None], chunks).aclose()  # every stream of open_partial is a generator
    complete = bytes(head[: head.rfind(b"\n") + 1])
    return [json.loads(line) for line in complete.splitlines()[:count]]
