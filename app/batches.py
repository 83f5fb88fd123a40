"""Batches: creation, the lifecycle state machine, listing, cancel, progress."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import func, select

from app import clock, files
from app.auth import visible
from app.db import session_scope, write_scope
from app.errors import APIError, bad_request, not_found
from app.ids import new_id
from app.models import BatchRow, FileRow
from app.pagination import page
from app.schemas import (
    Batch,
    BatchErrors,
    BatchList,
    BatchUsage,
    CreateBatchRequest,
    InputTokensDetails,
    OutputTokensDetails,
    RequestCounts,
)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# The engine loop owns these: it picks them up in creation order, after a restart too.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling", "expired"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired", "failed"}),
    "finalizing": frozenset({"completed", "failed"}),
    "cancelling": frozenset({"cancelled"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "expired": frozenset(),
    "cancelled": frozenset(),
}

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class InvalidTransition(Exception):
    pass


@dataclass
class Progress:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0


def to_wire(row: BatchRow) -> Batch:
    errors = BatchErrors.model_validate(json.loads(row.errors_json)) if row.errors_json else None
    return Batch(
        id=row.id,
        endpoint=row.endpoint,
        model=row.model,
        errors=errors,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        status=row.status,  # type: ignore[arg-type]
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        created_at=row.created_at,
        in_progress_at=row.in_progress_at,
        expires_at=row.expires_at,
        finalizing_at=row.finalizing_at,
        completed_at=row.completed_at,
        failed_at=row.failed_at,
        expired_at=row.expired_at,
        cancelling_at=row.cancelling_at,
        cancelled_at=row.cancelled_at,
        request_counts=RequestCounts(total=row.total, completed=row.completed, failed=row.failed),
        usage=BatchUsage(
            input_tokens=row.input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=row.cached_tokens),
            output_tokens=row.output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=row.reasoning_tokens),
            total_tokens=row.input_tokens + row.output_tokens,
        ),
        metadata=json.loads(row.metadata_json) if row.metadata_json else None,
    )


def _check_request(request: CreateBatchRequest, windows: dict[str, int]) -> None:
    if request.endpoint not in ENDPOINTS:
        raise bad_request(
            f"Invalid value for 'endpoint': '{request.endpoint}'. Supported: {', '.join(ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    if request.completion_window not in windows:
        raise bad_request(
            f"Invalid value for 'completion_window': '{request.completion_window}'. Supported: {', '.join(windows)}.",
            param="completion_window",
            code="invalid_value",
        )
    _check_metadata(request.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(
            f"'metadata' has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.",
            param="metadata",
            code="invalid_value",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values at most {MAX_METADATA_VALUE}.",
                param="metadata",
                code="invalid_value",
            )


def create(
    *, db: Engine, request: CreateBatchRequest, windows: dict[str, int], owner: str, max_active: int
) -> BatchRow:
    _check_request(request, windows)
    with write_scope(db) as session:
        source = session.get(FileRow, request.input_file_id)
        if not files.usable(source, owner):
            raise not_found("File", request.input_file_id, param="input_file_id")
        assert source is not None
        _check_active_count(session, owner=owner, max_active=max_active)
        if source.purpose != "batch":
            raise bad_request(
                f"File {source.id} has purpose '{source.purpose}'; a batch needs a file with purpose 'batch'.",
                param="input_file_id",
                code="invalid_file_purpose",
            )
        created = clock.now()
        row = BatchRow(
            id=new_id("batch_"),
            created_ns=clock.now_ns(),
            endpoint=request.endpoint,
            input_file_id=request.input_file_id,
            completion_window=request.completion_window,
            status="validating",
            owner=owner,
            metadata_json=json.dumps(request.metadata) if request.metadata is not None else None,
            output_expires_after_seconds=(
                request.output_expires_after.seconds if request.output_expires_after else None
            ),
            created_at=created,
            expires_at=created + windows[request.completion_window],
        )
        session.add(row)
        session.commit()
    return row


def _check_active_count(session, *, owner: str, max_active: int) -> None:
    """Inside create's write transaction, so two concurrent creates cannot both take the last place."""
    if max_active <= 0:
        return
    statement = (
        select(func.count()).select_from(BatchRow).where(BatchRow.owner == owner, BatchRow.status.in_(ACTIVE))  # type: ignore[attr-defined]
    )
    if session.exec(statement).one() >= max_active:
        raise APIError(
            429,
            f"This API key already has {max_active} batches validating or running, the most allowed at once. "
            "Wait for one to finish, or cancel one.",
            param=None,
            code="too_many_active_batches",
        )


def get(*, db: Engine, batch_id: str, owner: str | None) -> BatchRow:
    with session_scope(db) as session:
        row = session.get(BatchRow, batch_id)
    if row is None or not visible(row.owner, owner):
        raise not_found("Batch", batch_id)
    return row


def list_batches(*, db: Engine, owner: str, limit: int, after: str | None) -> BatchList:
    with session_scope(db) as session:
        rows, has_more = page(session, BatchRow, owner=owner, filters=[], limit=limit, after=after, descending=True)
    data = [to_wire(r) for r in rows]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def transition(*, db: Engine, batch_id: str, to: str, new_files: Sequence[FileRow] = (), **fields: object) -> BatchRow:
    """Move a batch to `to`, stamping `<to>_at` once; fields and new file rows are written in the same transaction."""
    with write_scope(db) as session:
        session.add_all(new_files)
        row = session.get(BatchRow, batch_id)
        if row is None:
            raise not_found("Batch", batch_id)
        if to not in TRANSITIONS[row.status]:
            raise InvalidTransition(f"{batch_id}: {row.status} -> {to}")
        row.status = to
        stamp = f"{to}_at"
        if getattr(row, stamp) is None:
            setattr(row, stamp, clock.now())
        for name, value in fields.items():
            setattr(row, name, value)
        session.add(row)
        session.commit()
    return row


def request_cancel(*, db: Engine, batch_id: str, owner: str) -> BatchRow:
    """Idempotent while cancelling; a finished batch cannot be cancelled (400, which the SDK does not retry)."""
    row = get(db=db, batch_id=batch_id, owner=owner)
    if row.status == "cancelling":
        return row
    if row.status in TERMINAL or row.status == "finalizing":
        raise bad_request(
            f"Cannot cancel a batch with status '{row.status}'.",
            param="batch_id",
            code="batch_not_cancellable",
        )
    try:
        return transition(db=db, batch_id=batch_id, to="cancelling")
    except InvalidTransition:
        # The loop moved it on between our read and our write: answer with what it is now.
        return request_cancel(db=db, batch_id=batch_id, owner=owner)


def update(*, db: Engine, batch_id: str, **fields: object) -> BatchRow:
    with write_scope(db) as session:
        row = session.get(BatchRow, batch_id)
        if row is None:
            raise not_found("Batch", batch_id)
        for name, value in fields.items():
            setattr(row, name, value)
        session.add(row)
        session.commit()
    return row


def save_checkpoint(*, db: Engine, batch_id: str, progress: Progress, output_bytes: int, error_bytes: int) -> None:
    """Counts and usage together with the fsynced part-file lengths they describe, in one transaction."""
    update(db=db, batch_id=batch_id, output_bytes_done=output_bytes, error_bytes_done=error_bytes, **vars(progress))


def active(*, db: Engine) -> list[BatchRow]:
    with session_scope(db) as session:
        statement = (
            select(BatchRow)
            .where(BatchRow.status.in_(ACTIVE))  # type: ignore[attr-defined]
            .order_by(BatchRow.created_ns.asc())  # type: ignore[attr-defined]
        )
        return list(session.exec(statement).all())


def errors_json(errors: list) -> str:
    return BatchErrors(data=errors).model_dump_json()
