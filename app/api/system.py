from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import EngineDep, OwnerDep
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
def health(engine: EngineDep) -> JSONResponse:
    status = HealthStatus(status=engine.state, model=engine.model_name)
    return JSONResponse(status.model_dump(), status_code=200 if engine.state == "ok" else 503)
