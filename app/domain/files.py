"""Files: upload, list, read, delete. Bytes live in Storage; rows in SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NamedTuple

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from app.core import clock, failpoints
from app.core.auth import visible
from app.core.db import session_scope, write_scope
from app.core.storage import Storage
from app.domain.errors import InvalidRequest, NotFound
from app.domain.lifecycle import ACTIVE
from app.domain.models import BatchRow, DeletedObject, FileRow
from app.domain.pagination import page
from app.domain.schemas import FileList, OpenAIFile

UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"
# The owner of a shard's result files (`app.engine.batch.shards`): no key's digest, so no client lists or reads them;
# its parent joins them into its own and deletes them.
SHARD_OWNER = "vbatch:shard"


def to_wire(row: FileRow) -> OpenAIFile:
    return OpenAIFile(
        id=row.id,
        bytes=row.bytes,
        created_at=row.created_at,
        expires_at=row.expires_at,
        filename=row.filename,
        purpose=row.purpose,
        status="processed",
    )


def check_purpose(purpose: str) -> None:
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"Invalid value for 'purpose': '{purpose}'. Supported values are: {', '.join(UPLOAD_PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )


def record_upload(
    *,
    db: Engine,
    file_id: str,
    size: int,
    filename: str,
    purpose: str,
    ttl_seconds: int | None,
    owner: str,
    model: str | None = None,
) -> FileRow:
    """The file object for bytes already stored under `file_id`; until this commits, they are sweepable debris."""
    failpoints.ARMED.crash_here(failpoints.UPLOAD_SAVED)
    created = clock.now()
    row = FileRow(
        id=file_id,
        created_ns=clock.now_ns(),
        created_at=created,
        expires_at=created + ttl_seconds if ttl_seconds else None,
        bytes=size,
        filename=filename,
        purpose=purpose,
        owner=owner,
        model=model,
    )
    return insert(db=db, row=row)


def insert(*, db: Engine, row: FileRow) -> FileRow:
    with session_scope(db) as session:
        session.add(row)
        session.commit()
    return row


def get(*, db: Engine, file_id: str, owner: str | None) -> FileRow:
    with session_scope(db) as session:
        row = session.get(FileRow, file_id)
    if not usable(row, owner):
        raise NotFound("File", file_id)
    assert row is not None
    return row


class Content(NamedTuple):
    row: FileRow
    chunks: AsyncIterator[bytes]
    size: int


async def open_content(*, db: Engine, storage: Storage, file_id: str, owner: str | None) -> Content:
    """The file and its bytes, opened before anyone answers with them: a delete from here on cannot cut the stream
    short (an open file reads whole once unlinked; an object store's GET is under way). NotFound if a delete got
    there first."""
    row = await asyncio.to_thread(get, db=db, file_id=file_id, owner=owner)
    opened = await storage.open_prefix(file_id)
    if opened is None:
        raise NotFound("File", file_id)
    return Content(row, *opened)


def usable(row: FileRow | None, owner: str | None) -> bool:
    """Whether `owner` may see and use the file: it exists, has not expired, and is theirs. Someone else's file is
    "not found", not "forbidden": its existence is not ours to tell."""
    if row is None or not visible(row.owner, owner):
        return False
    return row.expires_at is None or row.expires_at > clock.now()


def list_files(*, db: Engine, owner: str, purpose: str | None, limit: int, order: str, after: str | None) -> FileList:
    filters: list = [] if purpose is None else [FileRow.purpose == purpose]
    expires_at = col(FileRow.expires_at)
    filters.append(expires_at.is_(None) | (expires_at > clock.now()))
    with session_scope(db) as session:
        rows, has_more = page(
            session, FileRow, owner=owner, filters=filters, limit=limit, after=after, descending=order == "desc"
        )
    data = [to_wire(r) for r in rows]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def _active_readers(session: Session, file_id: str) -> list[str]:
    statement = select(BatchRow.id).where(col(BatchRow.input_file_id) == file_id, col(BatchRow.status).in_(ACTIVE))
    return list(session.exec(statement).all())


async def delete(
    *, db: Engine, storage: Storage, file_id: str, owner: str | None, keep_if_in_use: bool = False
) -> None:
    """The row goes and a tombstone takes its place, in one write transaction; the bytes go after it commits.
    `keep_if_in_use` (the console) refuses while an active batch reads the file; the API deletes it regardless, as
    OpenAI's does (the batch keeps its own link to the bytes)."""
    await asyncio.to_thread(_replace_with_tombstone, db, file_id, owner, keep_if_in_use)
    await storage.delete(file_id)


def _replace_with_tombstone(db: Engine, file_id: str, owner: str | None, keep_if_in_use: bool) -> None:
    with write_scope(db) as session:
        row = session.get(FileRow, file_id, with_for_update=True)  # a batch being created from it waits, or we do
        if row is None or not visible(row.owner, owner):
            raise NotFound("File", file_id)
        readers = _active_readers(session, file_id) if keep_if_in_use else []
        if readers:
            raise InvalidRequest(f"File {file_id} is the input of {', '.join(readers)}, still running; it is kept.")
        session.delete(row)
        session.add(DeletedObject(id=row.id, created_ns=row.created_ns, owner=row.owner))
        session.commit()
