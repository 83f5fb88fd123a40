"""`POST /v1/batches/{id}/retry` (a vbatch extension): a new batch of exactly the lines of an ended batch that did not
succeed and may on a second try, and the lines left out with the reason.

A line's fate is read from the ended batch's result files, laid out as OpenAI lays them out. A line in the output
file succeeded. An error-file line with `error` and no response (cancelled, expired, its engine crashed) never got
an answer, and one whose response is a 5xx or a 429 got one that a second try may change: those lines run again. Any
other 4xx is the request's own fault (a bad parameter, a prompt longer than the model takes): the same bytes would
fail the same way, so the line is listed instead. A line with no result at all (a batch failed from its last
checkpoint) never ran, and runs again.

The ended batch's run files (its copy of the input, its index) went with its run, so the input file object is read
once, line by line; the new input holds each chosen line's bytes as the input had them, in input order, each ended by
a newline. The new batch keeps the endpoint, completion window, output expiry and metadata, plus `retry_of`; a second
retry of the same batch makes another batch of the same lines (a retry is not idempotent). `retry_chain` finds a
batch's retries again (`vbatch merge`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core.db import session_scope
from app.core.ids import new_id
from app.core.storage import CHUNK_BYTES, Storage
from app.domain import batches, files
from app.domain.errors import InvalidRequest, NotEnded, NotFound
from app.domain.lifecycle import TERMINAL, BatchStatus
from app.domain.models import BatchRow
from app.domain.results import result_head
from app.domain.schemas import BatchRetry, CreateBatchRequest, ExpiresAfter, NotRetriedLine
from app.domain.validation import numbered_lines

RETRY_OF = "retry_of"
# The answer stays small whatever the batch: the first lines left out, and how many there were.
NOT_RETRIED_LISTED = 100
REASON_CHARS = 300


@dataclass(frozen=True)
class Failure:
    """How an error-file line failed: the handler's status code (None: no answer at all) and why."""

    status_code: int | None
    reason: str

    @property
    def retryable(self) -> bool:
        return self.status_code is None or self.status_code == 429 or self.status_code >= 500


def failure_of(record: dict) -> Failure:
    """An error-file line's failure, wherever OpenAI's layout puts its error: `error`, or the response's body."""
    response = record.get("response")
    if not isinstance(response, dict):
        error = record.get("error")
        error = error if isinstance(error, dict) else {}
        return Failure(None, _reason(error.get("code"), error.get("message")))
    body = response.get("body")
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    status = response.get("status_code")
    # OpenAI's code says what failed ("context_length_exceeded"); a body without one, its type.
    kind = error.get("code") if isinstance(error.get("code"), str) else error.get("type")
    return Failure(status if isinstance(status, int) else None, _reason(kind, error.get("message")))


def _reason(kind: object, message: object) -> str:
    return ": ".join(str(part) for part in (kind, message) if part)[:REASON_CHARS] or "no reason given"


@dataclass
class Plan:
    """The lines a retry runs again, as (offset, length) in the input, in input order; and those it leaves out."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    not_retried: list[NotRetriedLine] = field(default_factory=list)
    not_retried_count: int = 0

    def leave_out(self, custom_id: str, number: int, failure: Failure) -> None:
        self.not_retried_count += 1
        if len(self.not_retried) < NOT_RETRIED_LISTED:
            status = failure.status_code or 0
            self.not_retried.append(
                NotRetriedLine(custom_id=custom_id, line=number, status_code=status, reason=failure.reason)
            )


@dataclass(frozen=True)
class Sources:
    """Local paths to read an ended batch's input and result files from (None: the batch has no such file)."""

    input: Path
    output: Path | None
    error: Path | None


def request_custom_id(data: bytes) -> str | None:
    """An input line's custom_id; None if the line is not a request with one (an input never validated)."""
    try:
        request = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's stack
        return None
    custom_id = request.get("custom_id") if isinstance(request, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _succeeded(path: Path | None) -> set[str]:
    if path is None:
        return set()
    with path.open("rb") as src:
        return {result_head(line).custom_id for line in src if line.strip()}


def _failures(path: Path | None) -> dict[str, Failure]:
    failures: dict[str, Failure] = {}
    if path is None:
        return failures
    with path.open("rb") as src:
        for line in src:
            if line.strip():
                record = json.loads(line)
                failures[record["custom_id"]] = failure_of(record)
    return failures


def plan(sources: Sources) -> Plan:
    """Which input lines run again (one pass over each file; blocking: call it on a thread)."""
    succeeded, failures = _succeeded(sources.output), _failures(sources.error)
    chosen = Plan()
    for line in numbered_lines(sources.input):
        custom_id = request_custom_id(line.data)
        if custom_id is not None and custom_id in succeeded:
            continue
        failure = failures.get(custom_id) if custom_id is not None else None
        if failure is None or failure.retryable:
            chosen.spans.append((line.offset, len(line.data)))
        else:
            assert custom_id is not None
            chosen.leave_out(custom_id, line.number, failure)
    return chosen


def check_ended(row: BatchRow) -> None:
    if row.status not in TERMINAL:
        raise NotEnded(row.id, row.status)
    if row.status == BatchStatus.FAILED and row.in_progress_at is None:
        raise InvalidRequest(
            f"Batch {row.id} failed before it ran a line (its `errors` say why): its input would fail the same way. "
            "Fix the input and create a new batch.",
            param="batch_id",
            code="batch_never_ran",
        )


def retry_metadata(row: BatchRow, replacement: dict[str, str] | None) -> dict[str, str]:
    """The retried batch's metadata (or `replacement`) with `retry_of` naming it; refused when that would pass
    OpenAI's limit on pairs, rather than drop one of the caller's."""
    kept = replacement if replacement is not None else json.loads(row.metadata_json or "{}")
    metadata = {key: value for key, value in kept.items() if key != RETRY_OF} | {RETRY_OF: row.id}
    most = batches.MAX_METADATA_PAIRS
    if len(metadata) <= most:
        return metadata
    if replacement is None:
        message = (
            f"The metadata of batch {row.id} has {len(kept)} pairs, so `{RETRY_OF}` would make {len(metadata)}, "
            f"above the {most} allowed. Send `metadata` with at most {most - 1} pairs in the request body: it "
            "replaces the retried batch's."
        )
    else:
        message = (
            f"'metadata' has {len(kept)} pairs, and the retry adds `{RETRY_OF}`: {len(metadata)} in all, above the "
            f"{most} allowed. Send at most {most - 1}."
        )
    raise InvalidRequest(message, param="metadata", code="metadata_full")


async def _local(*, db: Engine, storage: Storage, file_id: str | None, owner: str, what: str) -> Path | None:
    if file_id is None:
        return None
    try:
        await asyncio.to_thread(files.get, db=db, file_id=file_id, owner=owner)
        return await storage.local_path(file_id)
    except (NotFound, FileNotFoundError):
        raise _gone(what, file_id) from None


def _gone(what: str, file_id: str) -> InvalidRequest:
    return InvalidRequest(
        f"The {what} file {file_id} of this batch is gone (deleted or expired): the lines to retry cannot be told.",
        param="batch_id",
        code=f"{what}_file_not_found",
    )


async def sources_of(*, db: Engine, storage: Storage, row: BatchRow) -> Sources:
    """The ended batch's input and result files, on the local disk (an object store's downloaded)."""
    check_ended(row)
    found = [
        await _local(db=db, storage=storage, file_id=file_id, owner=row.owner, what=what)
        for what, file_id in (
            ("input", row.input_file_id),
            ("output", row.output_file_id),
            ("error", row.error_file_id),
        )
    ]
    assert found[0] is not None
    return Sources(found[0], found[1], found[2])


async def planned(*, db: Engine, storage: Storage, row: BatchRow) -> tuple[Sources, Plan]:
    sources = await sources_of(db=db, storage=storage, row=row)
    try:
        return sources, await asyncio.to_thread(plan, sources)
    except FileNotFoundError:
        raise InvalidRequest(
            f"A file of batch {row.id} was deleted while it was read.", code="file_not_found"
        ) from None


async def retryable_lines(*, db: Engine, storage: Storage, row: BatchRow) -> int:
    """How many lines a retry of `row` would run now (0 when it cannot be retried): the console's Retry button. A
    batch whose every line succeeded is told from its counts, without reading its files."""
    if row.status == BatchStatus.COMPLETED and row.failed == 0 and row.completed == row.total:
        return 0
    try:
        _, chosen = await planned(db=db, storage=storage, row=row)
    except (InvalidRequest, NotEnded):
        return 0
    return len(chosen.spans)


def _nothing_to_retry(row: BatchRow, chosen: Plan) -> InvalidRequest:
    if chosen.not_retried_count == 0:
        message = f"Every line of batch {row.id} succeeded: there is nothing to retry."
    else:
        first = chosen.not_retried[0]
        message = (
            f"No line of batch {row.id} can succeed on a second try: {chosen.not_retried_count} failed with errors "
            f"a retry would repeat (the first, line {first.line}: {first.status_code} {first.reason})."
        )
    return InvalidRequest(message, param="batch_id", code="nothing_to_retry")


async def retry(
    *,
    db: Engine,
    storage: Storage,
    batch_id: str,
    owner: str,
    windows: dict[str, int],
    max_active: int,
    metadata: dict[str, str] | None = None,
) -> BatchRetry:
    """A new batch of the lines of `batch_id` that may succeed on a second try (see the module's docstring)."""
    row = await asyncio.to_thread(batches.get, db=db, batch_id=batch_id, owner=owner)
    check_ended(row)
    wanted = retry_metadata(row, metadata)
    sources, chosen = await planned(db=db, storage=storage, row=row)
    if not chosen.spans:
        raise _nothing_to_retry(row, chosen)
    created = await _create(
        db=db,
        storage=storage,
        row=row,
        sources=sources,
        spans=chosen.spans,
        metadata=wanted,
        windows=windows,
        max_active=max_active,
    )
    return BatchRetry(
        batch=batches.to_wire(created),
        retried=len(chosen.spans),
        not_retried_count=chosen.not_retried_count,
        not_retried=chosen.not_retried,
    )


async def _create(
    *,
    db: Engine,
    storage: Storage,
    row: BatchRow,
    sources: Sources,
    spans: Sequence[tuple[int, int]],
    metadata: dict[str, str],
    windows: dict[str, int],
    max_active: int,
) -> BatchRow:
    """The new input file, then the batch on it; the file goes again if the batch is refused (too many active)."""
    file_id = new_id("file-")
    try:
        size = await storage.save_stream(
            file_id, _lines_at(sources.input, spans), max_bytes=sum(length + 1 for _, length in spans), keep_free=True
        )
    except FileNotFoundError:  # the input deleted since the plan read it: as if it had gone before
        raise _gone("input", row.input_file_id) from None
    try:
        await asyncio.to_thread(
            files.record_upload,
            db=db,
            file_id=file_id,
            size=size,
            filename=f"{row.id}_retry.jsonl",
            purpose="batch",
            ttl_seconds=None,
            owner=row.owner,
        )
        request = _same_as(row, input_file_id=file_id, metadata=metadata)
        return await asyncio.to_thread(
            batches.create, db=db, request=request, windows=windows, owner=row.owner, max_active=max_active
        )
    except Exception:
        await _forget(db=db, storage=storage, file_id=file_id)
        raise


def _same_as(row: BatchRow, *, input_file_id: str, metadata: dict[str, str]) -> CreateBatchRequest:
    """The request that created `row`, on another input and with other metadata."""
    expiry = row.output_expires_after_seconds
    return CreateBatchRequest(
        input_file_id=input_file_id,
        endpoint=row.endpoint,
        completion_window=row.completion_window,
        metadata=metadata,
        output_expires_after=ExpiresAfter(anchor="created_at", seconds=expiry) if expiry else None,
    )


async def _forget(*, db: Engine, storage: Storage, file_id: str) -> None:
    try:
        await files.delete(db=db, storage=storage, file_id=file_id, owner=None)
    except NotFound:  # its row was never written
        await storage.delete(file_id)


async def _lines_at(path: Path, spans: Sequence[tuple[int, int]]) -> AsyncIterator[bytes]:
    """The input's lines at `spans`, each ended by a newline, read on a thread about a megabyte at a time."""
    for group in _groups(spans):
        yield await asyncio.to_thread(_read_spans, path, group)


def _groups(spans: Sequence[tuple[int, int]]) -> Iterator[Sequence[tuple[int, int]]]:
    start, size = 0, 0
    for end, (_, length) in enumerate(spans, 1):
        size += length
        if size >= CHUNK_BYTES:
            yield spans[start:end]
            start, size = end, 0
    if start < len(spans):
        yield spans[start:]


def _read_spans(path: Path, spans: Sequence[tuple[int, int]]) -> bytes:
    parts = []
    with path.open("rb") as src:
        for offset, length in spans:
            src.seek(offset)
            parts.append(src.read(length) + b"\n")
    return b"".join(parts)


def retried_of(row: BatchRow) -> str | None:
    metadata = json.loads(row.metadata_json) if row.metadata_json else {}
    value = metadata.get(RETRY_OF)
    return value if isinstance(value, str) else None


def retry_chain(*, db: Engine, batch_id: str, owner: str | None) -> list[BatchRow]:
    """The batches `batch_id` is one of: the first batch, its retries, their retries..., in creation order (the
    same owner's only: `retry_of` is metadata any client may set)."""
    row = batches.get(db=db, batch_id=batch_id, owner=owner)
    seen = {row.id}
    while (up := retried_of(row)) is not None and up not in seen:
        try:
            row = batches.get(db=db, batch_id=up, owner=row.owner)
        except NotFound:
            break
        seen.add(row.id)
    with session_scope(db) as session:
        statement = select(BatchRow).where(
            col(BatchRow.owner) == row.owner,
            col(BatchRow.parent_id).is_(None),
            col(BatchRow.metadata_json).contains(f'"{RETRY_OF}"'),
        )
        retries = list(session.exec(statement).all())
    chain, frontier = {row.id: row}, [row.id]
    while frontier:
        parents = set(frontier)
        frontier = [each.id for each in retries if retried_of(each) in parents and each.id not in chain]
        chain |= {each.id: each for each in retries if each.id in frontier}
    return sorted(chain.values(), key=lambda each: each.created_ns)
