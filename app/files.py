"""Files: upload, list, read, delete. Bytes live in Storage; rows in SQLite."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy.engine import Engine
from sqlmodel import col

from app import clock, failpoints
from app.db import session_scope
from app.errors import APIError, bad_request, not_found
from app.ids import new_id
from app.models import FileRow
from app.pagination import page
from app.schemas import FileList, OpenAIFile
from app.storage import Storage, UploadTooLarge

UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"


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


async def create_upload(
    *,
    db: Engine,
    storage: Storage,
    chunks: AsyncIterator[bytes],
    filename: str,
    purpose: str,
    ttl_seconds: int | None,
    max_bytes: int,
) -> FileRow:
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(
            f"Invalid value for 'purpose': '{purpose}'. Supported values are: {', '.join(UPLOAD_PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )
    file_id = new_id("file-")
    try:
        size = await storage.save_stream(file_id, chunks, max_bytes=max_bytes)
    except UploadTooLarge:
        message = f"File is too large. The limit is {max_bytes} bytes."
        raise APIError(413, message, param="file", code="file_too_large") from None
    failpoints.crash_here(failpoints.UPLOAD_SAVED)
    created = clock.now()
    row = FileRow(
        id=file_id,
        created_ns=clock.now_ns(),
        created_at=created,
        expires_at=created + ttl_seconds if ttl_seconds else None,
        bytes=size,
        filename=filename,
        purpose=purpose,
    )
    return insert(db=db, row=row)


def insert(*, db: Engine, row: FileRow) -> FileRow:
    with session_scope(db) as session:
        session.add(row)
        session.commit()
    return row


def get(*, db: Engine, file_id: str) -> FileRow:
    with session_scope(db) as session:
        row = session.get(FileRow, file_id)
    if row is None or _expired(row):
        raise not_found("File", file_id)
    return row


def _expired(row: FileRow) -> bool:
    return row.expires_at is not None and row.expires_at <= clock.now()


def list_files(*, db: Engine, purpose: str | None, limit: int, order: str, after: str | None) -> FileList:
    filters: list = [] if purpose is None else [FileRow.purpose == purpose]
    expires_at = col(FileRow.expires_at)
    filters.append(expires_at.is_(None) | (expires_at > clock.now()))
    with session_scope(db) as session:
        rows, has_more = page(session, FileRow, filters=filters, limit=limit, after=after, descending=order == "desc")
    data = [to_wire(r) for r in rows]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


async def delete(*, db: Engine, storage: Storage, file_id: str) -> None:
    with session_scope(db) as session:
        row = session.get(FileRow, file_id)
        if row is None:
            raise not_found("File", file_id)
        session.delete(row)
        session.commit()
    await storage.delete(file_id)
