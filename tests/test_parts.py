"""Result part files: a checkpoint cancelled in the middle of its write (the ticker that calls it is cancelled
whenever a batch's work ends) must not lose the lines it had taken from the buffers."""

from __future__ import annotations

import asyncio
import json

from app import batches
from app.db import make_engine
from app.engine.parts import PartFiles
from app.migrate import upgrade_to_head
from app.models import BatchRow
from app.results import Outcome
from app.storage import Storage


def test_a_cancelled_checkpoint_still_lands_its_lines(tmp_path):
    path = tmp_path / "state.db"
    upgrade_to_head(path)
    db = make_engine(path)
    row = BatchRow(
        id="batch_x", created_ns=1, endpoint="/v1/chat/completions", input_file_id="file-in",
        completion_window="24h", status="in_progress", created_at=1, total=6,
    )  # fmt: skip
    with batches.write_scope(db) as session:
        session.add(row)
        session.commit()
    storage = Storage(tmp_path / "files")
    (storage.path("file-in")).write_bytes(b"")

    async def scenario() -> PartFiles:
        parts = PartFiles(storage, row)
        await parts.open()
        for number in range(1, 7):
            parts.record(number, Outcome(custom_id=f"c{number}", status_code=200, body={"ok": number}))
        ticker = asyncio.create_task(parts.checkpoint(db))
        await asyncio.sleep(0)  # the checkpoint has taken the buffers and is writing them
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        await parts.checkpoint(db)
        await parts.close()
        return parts

    parts = asyncio.run(scenario())
    written = [json.loads(line)["custom_id"] for line in parts.output.path.read_bytes().splitlines()]
    assert written == [f"c{n}" for n in range(1, 7)]
    saved = batches.get(db=db, batch_id="batch_x", owner=None)
    assert saved.completed == 6 and saved.output_bytes_done == parts.output.path.stat().st_size
