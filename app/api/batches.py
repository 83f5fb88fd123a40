from __future__ import annotations

from typing import Annotated, NoReturn

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.deps import DbDep, EngineDep, EstimateSlotsDep, OwnerDep, SettingsDep, StorageDep
from app.domain import batches, retry
from app.domain.partial_output import Kind, open_partial
from app.domain.schemas import (
    Batch,
    BatchEstimate,
    BatchList,
    BatchProgress,
    BatchRetry,
    CreateBatchRequest,
    ErrorResponse,
    RetryBatchRequest,
)
from app.engine.online import estimating

router = APIRouter(
    prefix="/v1/batches",
    tags=["batches"],
    responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}},
)


@router.post("", response_model=Batch, responses={404: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
def create_batch(
    body: CreateBatchRequest, db: DbDep, settings: SettingsDep, engine: EngineDep, owner: OwnerDep
) -> Batch:
    row = batches.create(
        db=db,
        request=body,
        windows=settings.allowed_windows,
        owner=owner,
        max_active=settings.max_active_batches_per_key,
    )
    engine.wake()
    return batches.to_wire(row)


@router.post(
    "/estimate",
    response_model=BatchEstimate,
    summary="Estimate a batch before creating it (vbatch extension)",
    description=(
        "Takes the body of `POST /v1/batches` and creates nothing: the file's lines, their prompt tokens (the served "
        "model's tokenizer, chat template applied), the most output tokens they allow, the output, cached share, "
        "run time, GPU-seconds and (with VBATCH_GPU_HOUR_PRICE) cost expected from this engine's earlier batches of "
        "the same model and endpoint (`basis` says which; null where there are none). A file that would fail "
        "validation gets validation's errors, with line numbers, in `errors`. Not part of OpenAI's API."
    ),
    responses={404: {"model": ErrorResponse}, 429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
)
async def estimate_batch(
    body: CreateBatchRequest,
    db: DbDep,
    settings: SettingsDep,
    storage: StorageDep,
    engine: EngineDep,
    owner: OwnerDep,
    slots: EstimateSlotsDep,
) -> BatchEstimate:
    with slots.taken(owner):
        return await estimating.estimate(
            db=db, storage=storage, settings=settings, engine=engine, request=body, owner=owner
        )


@router.get("/estimate", include_in_schema=False, response_model=None)
def estimate_answers_post_only() -> NoReturn:
    """A 405, not `GET /v1/batches/{batch_id}` of a batch named "estimate" (a 404 that misleads)."""
    raise StarletteHTTPException(405, "Method Not Allowed")


@router.get("", response_model=BatchList)
def list_batches(
    db: DbDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> BatchList:
    return batches.list_batches(db=db, owner=owner, limit=limit, after=after)


@router.get("/{batch_id}", response_model=Batch, responses={404: {"model": ErrorResponse}})
def retrieve_batch(batch_id: str, db: DbDep, owner: OwnerDep) -> Batch:
    return batches.to_wire(batches.get(db=db, batch_id=batch_id, owner=owner))


@router.post("/{batch_id}/cancel", response_model=Batch, responses={404: {"model": ErrorResponse}})
def cancel_batch(batch_id: str, db: DbDep, engine: EngineDep, owner: OwnerDep) -> Batch:
    row = batches.request_cancel(db=db, batch_id=batch_id, owner=owner)
    engine.wake()
    return batches.to_wire(row)


@router.get(
    "/{batch_id}/progress",
    response_model=BatchProgress,
    summary="Live progress (vbatch extension)",
    description=(
        "The batch's request counts with requests/s, output tokens/s as the engine generates them, an ETA (null "
        "until one can be estimated) and the timeline of its run; before it runs, what it waits for (`waiting`); "
        "the engine time its requests used (`gpu_seconds`) and, with VBATCH_GPU_HOUR_PRICE set, what that cost. "
        "Not part of OpenAI's API."
    ),
    responses={404: {"model": ErrorResponse}},
)
def batch_progress(
    batch_id: str, db: DbDep, engine: EngineDep, owner: OwnerDep, settings: SettingsDep
) -> BatchProgress:
    row = batches.get(db=db, batch_id=batch_id, owner=owner)
    return batches.progress(row, engine.live_stats(row.id), engine.served_models, settings.gpu_hour_price)


@router.get(
    "/{batch_id}/partial_output",
    response_class=StreamingResponse,
    summary="Partial output (vbatch extension)",
    description=(
        "The result lines written so far: while the batch runs, those up to its last checkpoint (they will not "
        "change); once it has ended, its whole output (or, with kind=error, error) file. Not part of OpenAI's API."
    ),
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        404: {"model": ErrorResponse},
    },
)
async def partial_output(
    batch_id: str, db: DbDep, storage: StorageDep, owner: OwnerDep, kind: Kind = "output"
) -> StreamingResponse:
    chunks, size = await open_partial(db=db, storage=storage, batch_id=batch_id, kind=kind, owner=owner)
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)})


@router.post(
    "/{batch_id}/retry",
    response_model=BatchRetry,
    summary="Retry what failed (vbatch extension)",
    description=(
        "Creates a batch of exactly the lines of this ended batch that did not succeed and may on a second try: "
        "those cancelled, expired or never run, and those answered with a 5xx or 429. Lines answered with another "
        "4xx would fail the same way: they are left out, the first listed in `not_retried`. The new batch has the "
        "same endpoint, completion window and metadata, plus `metadata.retry_of` (the body's `metadata`, if sent, "
        "replaces the copied one). Every call creates a new batch. Not part of OpenAI's API."
    ),
    responses={404: {"model": ErrorResponse}, 409: {"model": ErrorResponse}, 429: {"model": ErrorResponse}},
)
async def retry_batch(
    batch_id: str,
    db: DbDep,
    storage: StorageDep,
    settings: SettingsDep,
    engine: EngineDep,
    owner: OwnerDep,
    body: RetryBatchRequest | None = None,
) -> BatchRetry:
    answer = await retry.retry(
        db=db,
        storage=storage,
        batch_id=batch_id,
        owner=owner,
        windows=settings.allowed_windows,
        max_active=settings.max_active_batches_per_key,
        metadata=body.metadata if body is not None else None,
    )
    engine.wake()
    return answer
