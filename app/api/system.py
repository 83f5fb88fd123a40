from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import EngineDep, OwnerDep, SettingsDep, StorageDep
from app.core.db import write_problem
from app.domain.errors import NotFound
from app.domain.schemas import ErrorResponse, HealthStatus, Model, ModelList

router = APIRouter(tags=["system"])


@router.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
def list_models(engine: EngineDep, _: OwnerDep) -> ModelList:
    return ModelList(
        data=[Model(id=name, created=engine.started_at, owned_by="vbatch") for name in engine.served_models]
    )


@router.get(
    "/v1/models/{model:path}",
    response_model=Model,
    responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
)
def retrieve_model(model: str, engine: EngineDep, _: OwnerDep) -> Model:
    if model not in engine.served_models:
        raise NotFound("Model", model, param="model", code="model_not_found")
    return Model(id=model, created=engine.started_at, owned_by="vbatch")


@router.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
def health(engine: EngineDep, settings: SettingsDep, storage: StorageDep) -> JSONResponse:
    problems = [
        problem
        for problem in (
            write_problem(settings.database_path),
            _disk_problem(storage.free_bytes(), settings.min_free_disk_bytes),
            None if storage.reserve.held else "the disk filled up: its reserve is released until there is room again",
            engine.scheduler_error,
        )
        if problem is not None
    ]
    state = "unavailable" if engine.state == "ok" and problems else engine.state
    status = HealthStatus(status=state, model=engine.model_name, problems=problems)
    return JSONResponse(status.model_dump(), status_code=200 if state == "ok" else 503)


def _disk_problem(free: int, minimum: int) -> str | None:
    if free >= minimum:
        return None
    return f"the data directory has {free} bytes free, under the {minimum} needed (VBATCH_MIN_FREE_DISK_BYTES)"
