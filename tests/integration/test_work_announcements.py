"""Workers hear of new work from the database as it commits (Postgres LISTEN/NOTIFY), instead of at their next
poll; SQLite announces nothing and its workers poll."""

from __future__ import annotations

import asyncio

import pytest

from app.core.db import make_engine, work_announcements
from tests.helpers import create_batch, jsonl, request_line, upload

pytestmark = pytest.mark.both_backends


def test_a_created_and_a_cancelled_batch_are_announced_when_they_commit(client, fake_engine, settings, backend):
    fake_engine.executor.answer_first = 0  # the batch stays in progress, to be cancelled
    db = make_engine(settings.database)

    async def heard_of(action) -> int:
        announcements = work_announcements(db)
        heard = 0
        try:
            async with asyncio.timeout(10):
                async for _ in announcements:  # the first: listening from here on
                    heard += 1
                    if heard == 1:
                        await asyncio.to_thread(action)
                    else:
                        break
        finally:
            await announcements.aclose()
        return heard

    try:
        source = upload(client, jsonl([request_line("a")]))
        if backend == "sqlite":
            assert asyncio.run(heard_of(lambda: None)) == 0
            return
        batch: dict = {}
        assert asyncio.run(heard_of(lambda: batch.update(create_batch(client, source["id"])))) == 2
        assert asyncio.run(heard_of(lambda: client.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status())) == 2
    finally:
        db.dispose()
