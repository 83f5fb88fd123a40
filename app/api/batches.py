from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from app.api.deps import DbDep, EngineDep, OwnerDep, SettingsDep, StorageDep
from app.domain import batches
from app.domain.partial_output import Kind, open_partial
from app.domain.schemas import Batch, BatchList, BatchProgress, CreateBatchRequest, ErrorResponse

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
