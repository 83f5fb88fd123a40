"""Retention: files past their `expires_at` (an upload's `expires_after`, the batch-file and output TTLs, a batch's
`output_expires_after`) leave the disk and the database; webhook events that are done leave the outbox; shards left
behind by a crash after their parent ended go with their files.

A file an active batch still reads is never deleted, whatever its expiry: the batch keeps it until it ends (its
expiry hides it from its owner all the same). Each deletion leaves the same tombstone as a client's delete, so a
list cursor that names it still pages on.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.engine import Engine
from sqlmodel import col, delete, select

from app.core.db import session_scope, write_scope
from app.core.storage import Storage
from app.domain import batches, files
from app.domain.errors import NotFound
from app.domain.lifecycle import ACTIVE
from app.domain.models import BatchRow, FileRow, WebhookEvent

log = logging.getLogger("vbatch.retention")


def expired_files(*, db: Engine, now: int) -> list[str]:
    """Ids of files past their expiry that no active batch reads."""
    with session_scope(db) as session:
        in_use = select(BatchRow.input_file_id).where(col(BatchRow.status).in_(ACTIVE))
        statement = (
            select(FileRow.id)
            .where(col(FileRow.expires_at).is_not(None), col(FileRow.expires_at) <= now)
            .where(col(FileRow.id).not_in(in_use))
        )
        return list(session.exec(statement).all())


async def sweep(*, db: Engine, storage: Storage, now: int, keep_events_seconds: int) -> int:
    """Delete what has expired; the number of files deleted."""
    removed = 0
    for file_id in await asyncio.to_thread(expired_files, db=db, now=now):
        try:
            await files.delete(db=db, storage=storage, file_id=file_id, owner=None)
            removed += 1
        except NotFound:  # its owner deleted it meanwhile
            continue
    if leftovers := await asyncio.to_thread(batches.leftover_shards, db=db):
        await batches.forget_shards(db=db, storage=storage, shards=leftovers)
        log.info("retention: removed %d shards of batches that had ended", len(leftovers))
    await asyncio.to_thread(_forget_finished_events, db=db, before=now - keep_events_seconds)
    if removed:
        log.info("retention: deleted %d expired files", removed)
    return removed


def _forget_finished_events(*, db: Engine, before: int) -> None:
    with write_scope(db) as session:
        finished = col(WebhookEvent.delivered_at).is_not(None) | col(WebhookEvent.given_up_at).is_not(None)
        session.exec(delete(WebhookEvent).where(finished, col(WebhookEvent.created_at) < before))
        session.commit()
