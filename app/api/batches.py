from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app import batches
from app.api.deps import DbDep, EngineDep, SettingsDep
from app.schemas import Batch, BatchList, CreateBatchRequest, ErrorResponse

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses={400: {"model": ErrorResponse}})


@router.post("", response_model=Batch, responses={404: {"model": ErrorResponse}})
def create_batch(body: CreateBatchRequest, db: DbDep, settings: SettingsDep, engine: EngineDep) -> Batch:
    row = batches.create(db=db, request=body, windows=settings.allowed_windows)
    engine.wake()
    return batches.to_wire(row)


@router.get("", response_model=BatchList)
def list_batches(
    db: DbDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> BatchList:
    return batches.list_batches(db=db, limit=limit, after=after)


@router.get("/{batch_id}", response_model=Batch, responses={404: {"model": ErrorResponse}})
def retrieve_batch(batch_id: str, db: DbDep) -> Batch:
    return batches.to_wire(batches.get(db=db, batch_id=batch_id))


@router.post("/{batch_id}/cancel", response_model=Batch, responses={404: {"model": ErrorResponse}})
def cancel_batch(batch_id: str, db: DbDep, engine: EngineDep) -> Batch:
    row = batches.request_cancel(db=db, batch_id=batch_id)
    engine.wake()
    return batches.to_wire(row)
