"""`GET /v1/batches/{id}/partial_output` (a vbatch extension): the result lines a batch has so far.

While the batch runs, its part file up to the last checkpoint (lines that will not change); once it ends, its
published output or error file.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal, cast

from sqlalchemy.engine import Engine

from app.core.storage import Storage, no_bytes
from app.domain import batches
from app.domain.lifecycle import TERMINAL
from app.domain.results import part_names

Kind = Literal["output", "error"]


async def open_partial(
    *, db: Engine, storage: Storage, batch_id: str, kind: Kind, owner: str
) -> tuple[AsyncIterator[bytes], int]:
    # Twice: a batch can finish between reading its row and opening its part file, which it then removes.
    for _ in range(2):
        row = batches.get(db=db, batch_id=batch_id, owner=owner)
        file_id = row.output_file_id if kind == "output" else row.error_file_id
        if file_id is not None:
            opened = await storage.open_prefix(file_id)
        elif row.status in TERMINAL:
            return no_bytes(), 0
        else:
            part = part_names(row.id, row.parts_token)[0 if kind == "output" else 1]
            done = row.output_bytes_done if kind == "output" else row.error_bytes_done
            opened = await storage.open_part(part, done)
            if opened is None and done == 0:
                return no_bytes(), 0
        if opened is not None:
            return opened
    return no_bytes(), 0


async def first_lines(
    *, db: Engine, storage: Storage, batch_id: str, kind: Kind, owner: str, count: int, max_bytes: int = 256 * 1024
) -> list[dict]:
    """The first `count` result lines written so far (those that fit in `max_bytes`), parsed."""
    chunks, _ = await open_partial(db=db, storage=storage, batch_id=batch_id, kind=kind, owner=owner)
    head = bytearray()
    async for chunk in chunks:
        head.extend(chunk)
        if head.count(b"\n") >= count or len(head) >= max_bytes:
            break
    await cast(AsyncGenerator[bytes, None], chunks).aclose()  # both of open_partial's streams are generators
    complete = bytes(head[: head.rfind(b"\n") + 1])
    return [json.loads(line) for line in complete.splitlines()[:count]]
