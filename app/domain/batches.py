"""Batches: creation, the lifecycle state machine, listing, cancel, progress."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import aliased
from sqlmodel import col, func, select

from app.core import clock
from app.core.auth import visible
from app.core.db import announce_work, lock_name, session_scope, write_scope
from app.core.ids import new_id
from app.core.storage import Storage
from app.domain import events, files, leases, turns
from app.domain.cost import Spend, spend
from app.domain.errors import InvalidRequest, NotCancellable, NotFound, TooManyActive
from app.domain.leases import Lease
from app.domain.lifecycle import ACTIVE, TERMINAL, BatchStatus, InvalidTransition, check_move
from app.domain.models import BatchRow, FileRow
from app.domain.pagination import page
from app.domain.schemas import (
    Batch,
    BatchError,
    BatchErrors,
    BatchList,
    BatchProgress,
    BatchUsage,
    CreateBatchRequest,
    InputTokensDetails,
    OutputTokensDetails,
    RequestCounts,
    RunStats,
)

# What `vllm run-batch` accepts (vllm/entrypoints/launchers/run_batch.py, `build_endpoint_registry`, vLLM 0.32: chat,
# embeddings, score, rerank and audio) that vbatch can run, under OpenAI's /v1 prefix, plus the completions and
# responses endpoints `vllm serve` has. Score and rerank need a model that scores (a cross-encoder, num_labels 1, or
# an embedding model); any other engine answers such a line with an error of its own. Audio is left out: its lines
# fetch a `file_url` from the engine's host.
ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
)

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


@dataclass
class Progress:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    gpu_seconds: float = 0.0
    # How the answers ended, for estimates (`app.domain.estimates`): an answer cut at its cap (finish_reason
    # `length`) tells only that it would have run at least that long.
    cut_lines: int = 0
    cut_output_tokens: int = 0
    shortest_cut_output: int = 0  # 0: none cut
    longest_uncut_output: int = 0

    def plus(self, other: Progress) -> Progress:
        """The two together (a parent batch's, from its shards')."""
        summed = {name: value + getattr(other, name) for name, value in asdict(self).items()}
        cut_outputs = [each.shortest_cut_output for each in (self, other) if each.cut_lines]
        return Progress(
            **summed
            | {
                "shortest_cut_output": min(cut_outputs, default=0),
                "longest_uncut_output": max(self.longest_uncut_output, other.longest_uncut_output),
            }
        )


def progress_of(row: BatchRow) -> Progress:
    return Progress(**{name: getattr(row, name) for name in asdict(Progress())})


def _counts(row: BatchRow) -> RequestCounts:
    return RequestCounts(total=row.total, completed=row.completed, failed=row.failed)


def to_wire(row: BatchRow) -> Batch:
    errors = BatchErrors.model_validate(json.loads(row.errors_json)) if row.errors_json else None
    return Batch(
        id=row.id,
        endpoint=row.endpoint,
        model=row.model,
        errors=errors,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        status=BatchStatus(row.status),
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
        request_counts=_counts(row),
        usage=BatchUsage(
            input_tokens=row.input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=row.cached_tokens),
            output_tokens=row.output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=row.reasoning_tokens),
            total_tokens=row.input_tokens + row.output_tokens,
        ),
        metadata=json.loads(row.metadata_json) if row.metadata_json else None,
    )


def _check_text(request: CreateBatchRequest) -> None:
    """JSON can carry lone surrogates (`"\\udc00"`, which `json.dumps` writes for a surrogate-escaped filename):
    no UTF-8 text holds them, so such a value could be neither stored nor returned. It is refused here."""
    fields = [("input_file_id", request.input_file_id), ("endpoint", request.endpoint)]
    fields += [("completion_window", request.completion_window)]
    for key, value in (request.metadata or {}).items():
        fields += [("metadata", key), (f"metadata.{key}", value)]
    for param, value in fields:
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"'{param.encode(errors='replace').decode()}' holds text that is not valid Unicode (a lone surrogate).",
                param=param.encode(errors="replace").decode(),
                code="invalid_value",
            ) from None


def check_request(request: CreateBatchRequest, windows: dict[str, int]) -> None:
    """The body's own fields, before its input file is looked at (creation's first check, and an estimate's)."""
    _check_text(request)
    if request.endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"Invalid value for 'endpoint': '{request.endpoint}'. Supported: {', '.join(ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    if request.completion_window not in windows:
        raise InvalidRequest(
            f"Invalid value for 'completion_window': '{request.completion_window}'. Supported: {', '.join(windows)}.",
            param="completion_window",
            code="invalid_value",
        )
    _check_metadata(request.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"'metadata' has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.",
            param="metadata",
            code="invalid_value",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values at most {MAX_METADATA_VALUE}.",
                param="metadata",
                code="invalid_value",
            )


def create(
    *, db: Engine, request: CreateBatchRequest, windows: dict[str, int], owner: str, max_active: int
) -> BatchRow:
    check_request(request, windows)
    with write_scope(db) as session:
        # The input stays until this commits (a delete waits on its row); the count holds (a create waits).
        source = session.get(FileRow, request.input_file_id, with_for_update=True)
        lock_name(session, f"active-batches:{owner}")
        if not files.usable(source, owner):
            raise NotFound("File", request.input_file_id, param="input_file_id")
        assert source is not None
        _check_active_count(session, owner=owner, max_active=max_active)
        _check_purpose(source)
        created = clock.now()
        row = BatchRow(
            id=new_id("batch_"),
            created_ns=clock.now_ns(),
            endpoint=request.endpoint,
            input_file_id=request.input_file_id,
            completion_window=request.completion_window,
            status=BatchStatus.VALIDATING,
            owner=owner,
            model=source.model,
            metadata_json=json.dumps(request.metadata) if request.metadata is not None else None,
            output_expires_after_seconds=(
                request.output_expires_after.seconds if request.output_expires_after else None
            ),
            created_at=created,
            expires_at=created + windows[request.completion_window],
            turn=turns.next_turn(session, owner),
        )
        session.add(row)
        announce_work(session)
        session.commit()
    return row


def _check_purpose(source: FileRow) -> None:
    if source.purpose != "batch":
        raise InvalidRequest(
            f"File {source.id} has purpose '{source.purpose}'; a batch needs a file with purpose 'batch'.",
            param="input_file_id",
            code="invalid_file_purpose",
        )


def input_of(*, db: Engine, request: CreateBatchRequest, owner: str) -> FileRow:
    """The input file a batch of `request` would run, refused as `create` refuses it (an estimate's check)."""
    with session_scope(db) as session:
        source = session.get(FileRow, request.input_file_id)
    if not files.usable(source, owner):
        raise NotFound("File", request.input_file_id, param="input_file_id")
    assert source is not None
    _check_purpose(source)
    return source


def _check_active_count(session, *, owner: str, max_active: int) -> None:
    """Inside create's write transaction, so two concurrent creates cannot both take the last place."""
    if max_active <= 0:
        return
    statement = (
        select(func.count())
        .select_from(BatchRow)
        .where(BatchRow.owner == owner, col(BatchRow.status).in_(ACTIVE), col(BatchRow.parent_id).is_(None))
    )
    if session.exec(statement).one() >= max_active:
        raise TooManyActive(max_active)


def get(*, db: Engine, batch_id: str, owner: str | None) -> BatchRow:
    """A client (`owner` set) sees its own batches, never their shards; the engine (None) sees every row."""
    with session_scope(db) as session:
        row = session.get(BatchRow, batch_id)
    if row is None or not visible(row.owner, owner) or (owner is not None and row.parent_id is not None):
        raise NotFound("Batch", batch_id)
    return row


def shards_of(*, db: Engine, batch_id: str) -> list[BatchRow]:
    with session_scope(db) as session:
        statement = select(BatchRow).where(col(BatchRow.parent_id) == batch_id).order_by(col(BatchRow.shard))
        return list(session.exec(statement).all())


async def forget_shards(*, db: Engine, storage: Storage, shards: Sequence[BatchRow]) -> None:
    """Shards whose parent has ended with their results: their result files and rows go (no client sees them)."""
    for shard in shards:
        for file_id in (shard.output_file_id, shard.error_file_id):
            if file_id is not None:
                with contextlib.suppress(NotFound):  # an earlier try got that far
                    await files.delete(db=db, storage=storage, file_id=file_id, owner=None)
    await asyncio.to_thread(_delete_rows, db=db, ids=[shard.id for shard in shards])


def _delete_rows(*, db: Engine, ids: list[str]) -> None:
    with write_scope(db) as session:
        for row in session.exec(select(BatchRow).where(col(BatchRow.id).in_(ids))).all():
            session.delete(row)
        session.commit()


def leftover_shards(*, db: Engine) -> list[BatchRow]:
    """Shards of a parent that has ended: a crash between its commit and `forget_shards` left them."""
    parent = aliased(BatchRow)
    with session_scope(db) as session:
        statement = (
            select(BatchRow).join(parent, col(BatchRow.parent_id) == parent.id).where(col(parent.status).in_(TERMINAL))
        )
        return list(session.exec(statement).all())


def waiting_for(row: BatchRow, served_models: Collection[str]) -> str | None:
    """Why a batch no service holds has not started: no live worker serves its model (`served_models`: every model
    the live workers serve). It waits for one until its completion window ends (`app.domain.leases.claim`)."""
    unheld = row.lease_holder is None or (row.lease_expires_ns or 0) < clock.now_ns()
    if row.status != BatchStatus.VALIDATING or not unheld or row.model in (None, *served_models):
        return None
    return f"waiting for a worker that serves {row.model!r}"


def progress(
    row: BatchRow, live: RunStats | None, served_models: Collection[str], price: float | None = None
) -> BatchProgress:
    """The batch's counts with its live numbers while it runs; once it has ended, the timeline of its last run (its
    run may still be removing its run files, its numbers not yet dropped); before it runs, what it waits for. With
    `price` (USD per GPU-hour), what its engine time cost."""
    if row.status in TERMINAL:
        live = None
    timeline = live.timeline if live else (json.loads(row.timeline_json) if row.timeline_json else None)
    series = live.series if live else (json.loads(row.series_json) if row.series_json else [])
    return BatchProgress(
        **asdict(spent(row, price)),
        gpu_hour_price=price,
        id=row.id,
        status=BatchStatus(row.status),
        request_counts=_counts(row),
        requests_per_second=live.requests_per_second if live else None,
        output_tokens_per_second=live.output_tokens_per_second if live else None,
        eta_seconds=live.eta_seconds if live else None,
        timeline=timeline,
        series=series,
        waiting=waiting_for(row, served_models),
    )


def spent(row: BatchRow, price: float | None) -> Spend:
    """What the batch used and cost so far (`app.domain.cost`); its GPU-seconds unknown before it has run."""
    used = row.gpu_seconds if row.in_progress_at is not None else None
    return spend(used, input_tokens=row.input_tokens, output_tokens=row.output_tokens, price=price)


def spent_by_id(*, db: Engine, batch_ids: Collection[str], price: float | None) -> dict[str, Spend]:
    """`spent` for each of these batches (the console's list)."""
    with session_scope(db) as session:
        rows = session.exec(select(BatchRow).where(col(BatchRow.id).in_(list(batch_ids)))).all()
        return {row.id: spent(row, price) for row in rows}


def list_batches(
    *, db: Engine, owner: str, limit: int, after: str | None, status: BatchStatus | None = None
) -> BatchList:
    """Newest first; `status` narrows it (the console's filter; OpenAI's list has none)."""
    filters = [col(BatchRow.parent_id).is_(None)] + ([] if status is None else [col(BatchRow.status) == status])
    with session_scope(db) as session:
        rows, has_more = page(
            session, BatchRow, owner=owner, filters=filters, limit=limit, after=after, descending=True
        )
    data = [to_wire(r) for r in rows]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def transition(*, db: Engine, batch_id: str, to: BatchStatus, lease: Lease | None = None) -> BatchRow:
    """Move a batch to `to`, stamping the time it first got there; with `lease`, only while it holds."""
    return _move(db=db, batch_id=batch_id, to=to, lease=lease)


def start(
    *,
    db: Engine,
    batch_id: str,
    total: int,
    model: str | None,
    lease: Lease | None = None,
    shards: Sequence[BatchRow] = (),
) -> BatchRow:
    """Validated: the batch runs `total` requests for `model`, itself or, with `shards`, through them (created in the
    same transaction)."""
    return _move(
        db=db,
        batch_id=batch_id,
        to=BatchStatus.IN_PROGRESS,
        lease=lease,
        new_rows=shards,
        total=total,
        model=model,
        shards=len(shards),
    )


def end_with_errors(
    *, db: Engine, batch_id: str, to: BatchStatus, errors: Sequence[BatchError], lease: Lease | None = None
) -> BatchRow:
    """End a batch that ran no line (failed or expired) with `errors`, and no result files."""
    errors_json = BatchErrors(data=list(errors)).model_dump_json()
    return _move(db=db, batch_id=batch_id, to=to, lease=lease, errors_json=errors_json)


def end_with_files(
    *,
    db: Engine,
    batch_id: str,
    to: BatchStatus,
    output: FileRow | None,
    error: FileRow | None,
    progress: Progress,
    timeline: dict[str, float],
    series: Sequence[Sequence[float]] = (),
    errors: Sequence[BatchError] = (),
    lease: Lease | None = None,
) -> BatchRow:
    """End a batch with its result files: their File rows are created in the transaction that ends it, so a batch
    is never final without its files, nor a result file listed for a batch that has not ended."""
    extra = {"errors_json": BatchErrors(data=list(errors)).model_dump_json()} if errors else {}
    return _move(
        db=db,
        batch_id=batch_id,
        to=to,
        lease=lease,
        new_rows=[row for row in (output, error) if row is not None],
        output_file_id=output.id if output else None,
        error_file_id=error.id if error else None,
        timeline_json=json.dumps(timeline),
        series_json=json.dumps(list(series)),
        live_json=None,
        **extra,
        **vars(progress),
    )


def _move(
    *,
    db: Engine,
    batch_id: str,
    to: BatchStatus,
    lease: Lease | None = None,
    new_rows: Sequence[FileRow | BatchRow] = (),
    **fields: object,
) -> BatchRow:
    with write_scope(db) as session:
        session.add_all(new_rows)
        row = session.get(BatchRow, batch_id, with_for_update=True)
        if row is None:
            raise NotFound("Batch", batch_id)
        leases.check(row, lease)
        check_move(row.status, to)
        row.status = to
        now = clock.now()
        row.stamp(to, now)
        for name, value in fields.items():
            setattr(row, name, value)
        session.add(row)
        if to in TERMINAL and row.parent_id is None:  # a shard's end is no event: its parent's is
            session.add(events.for_batch(row, now=now))
        if to == BatchStatus.CANCELLING or any(isinstance(new, BatchRow) for new in new_rows):
            announce_work(session)
        session.commit()
    return row


def request_cancel(*, db: Engine, batch_id: str, owner: str) -> BatchRow:
    """Idempotent while cancelling; a finished batch cannot be cancelled (400, which the SDK does not retry)."""
    row = get(db=db, batch_id=batch_id, owner=owner)
    if row.status == BatchStatus.CANCELLING:
        return row
    if row.status in TERMINAL or row.status == BatchStatus.FINALIZING:
        raise NotCancellable(row.status)
    try:
        return transition(db=db, batch_id=batch_id, to=BatchStatus.CANCELLING)
    except InvalidTransition:
        # The loop moved it on between our read and our write: answer with what it is now.
        return request_cancel(db=db, batch_id=batch_id, owner=owner)


def save_checkpoint(
    *,
    db: Engine,
    batch_id: str,
    progress: Progress,
    output_bytes: int,
    error_bytes: int,
    lease: Lease | None = None,
    lease_seconds: float | None = None,
    live: RunStats | None = None,
) -> BatchStatus:
    """Counts and usage together with the fsynced part-file lengths they describe, in one statement; under a lease,
    only while it holds (`LeaseLost` otherwise), the part files then that lease's (`parts_token`), and the lease
    renewed for `lease_seconds` if given; with `live`, the run's live numbers. Returns the batch's status as the
    checkpoint found it: a cancel that came meanwhile shows."""
    values: dict[str, object] = {"output_bytes_done": output_bytes, "error_bytes_done": error_bytes, **vars(progress)}
    if lease is not None:
        values["parts_token"] = lease.token
    return _save_run(db, batch_id, values, lease, lease_seconds, live)


def save_live(*, db: Engine, batch_id: str, lease: Lease, lease_seconds: float, live: RunStats | None) -> BatchStatus:
    """Between two checkpoints: the run's live numbers and its lease renewed, in one statement (`save_checkpoint`'s
    terms); its counts stay those of its last checkpoint."""
    return _save_run(db, batch_id, {}, lease, lease_seconds, live)


def _save_run(
    db: Engine,
    batch_id: str,
    values: dict[str, object],
    lease: Lease | None,
    lease_seconds: float | None,
    live: RunStats | None,
) -> BatchStatus:
    statement = update(BatchRow).where(col(BatchRow.id) == batch_id)
    if lease is not None:
        statement = statement.where(
            col(BatchRow.lease_token) == lease.token, col(BatchRow.lease_holder) == lease.holder
        )
        if lease_seconds is not None:
            values["lease_expires_ns"] = clock.now_ns() + int(lease_seconds * 1e9)
    if live is not None:
        values["live_json"] = live.model_dump_json(exclude={"series"})
    with write_scope(db) as session:
        found = session.exec(statement.values(**values).returning(col(BatchRow.status))).first()  # type: ignore[call-overload]
        session.commit()
    if found is None:  # gone (NotFound), or its lease has passed on
        leases.check(get(db=db, batch_id=batch_id, owner=None), lease)
        raise leases.LeaseLost(batch_id)
    return BatchStatus(found[0])


def stored_live(row: BatchRow) -> RunStats | None:
    """The live numbers its run kept at its last checkpoint, while the batch is active."""
    if row.live_json is None or row.status not in ACTIVE:
        return None
    return RunStats.model_validate_json(row.live_json)


def active_among(*, db: Engine, batch_ids: Collection[str]) -> list[BatchRow]:
    """Those of these batches (a service's own) that are active, oldest first: read by their ids, whatever else is
    active (a fleet's queue may hold thousands)."""
    if not batch_ids:
        return []
    with session_scope(db) as session:
        statement = (
            select(BatchRow)
            .where(col(BatchRow.id).in_(list(batch_ids)), col(BatchRow.status).in_(ACTIVE))
            .order_by(col(BatchRow.created_ns).asc())
        )
        return list(session.exec(statement).all())


def active(*, db: Engine) -> list[BatchRow]:
    with session_scope(db) as session:
        statement = (
            select(BatchRow)
            .where(BatchRow.status.in_(ACTIVE))  # type: ignore[attr-defined]
            .order_by(BatchRow.created_ns.asc())  # type: ignore[attr-defined]
        )
        return list(session.exec(statement).all())


def count_by_status(*, db: Engine) -> dict[str, int]:
    with session_scope(db) as session:
        statement = (
            select(BatchRow.status, func.count()).where(col(BatchRow.parent_id).is_(None)).group_by(BatchRow.status)
        )
        return {str(status): count for status, count in session.exec(statement).all()}


def lines_waiting(*, db: Engine) -> int:
    """Lines of active batches without a result yet (validated ones: before validation the count is unknown)."""
    with session_scope(db) as session:
        waiting = func.coalesce(func.sum(BatchRow.total - BatchRow.completed - BatchRow.failed), 0)
        statement = select(waiting).where(col(BatchRow.status).in_(ACTIVE), col(BatchRow.parent_id).is_(None))
        return int(session.exec(statement).one())


def owned(*, db: Engine, batch_ids: set[str], owner: str) -> set[str]:
    """Those of `batch_ids` that are `owner`'s (a shard is its parent's owner's)."""
    if not batch_ids:
        return set()
    with session_scope(db) as session:
        statement = select(BatchRow.id).where(col(BatchRow.id).in_(batch_ids), col(BatchRow.owner) == owner)
        return set(session.exec(statement).all())
