from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy.engine import Engine

from app.api.deps import DbDep, EngineDep, MetricsDep, OwnerDep, SettingsDep, StorageDep
from app.core.config import Settings
from app.core.db import write_problem
from app.core.storage import Storage
from app.domain import batches
from app.domain.adapters import Adapter
from app.domain.errors import NotFound
from app.domain.schemas import ErrorResponse, HealthStatus, Model, ModelList
from app.engine.online.view import EngineView
from app.engine.telemetry.metrics import key_label

router = APIRouter(tags=["system"])


@router.get(
    "/v1/models",
    response_model=ModelList,
    response_model_exclude_none=True,
    responses={401: {"model": ErrorResponse}},
)
def list_models(engine: EngineDep, _: OwnerDep) -> ModelList:
    adapters = {adapter.name: adapter for adapter in engine.adapters}
    return ModelList(data=[_card(name, engine, adapters.get(name)) for name in engine.served_models])


@router.get(
    "/v1/models/{model:path}",
    response_model=Model,
    response_model_exclude_none=True,
    responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
)
def retrieve_model(model: str, engine: EngineDep, _: OwnerDep) -> Model:
    if model not in engine.served_models:
        raise NotFound("Model", model, param="model", code="model_not_found")
    return _card(model, engine, next((a for a in engine.adapters if a.name == model), None))


def _card(name: str, engine: EngineView, adapter: Adapter | None) -> Model:
    """A model's card; an adapter's names its base model, never where the server keeps it (`vllm serve` shows its
    path as `root`: to every key, a detail of the server's disk)."""
    if adapter is None:
        return Model(id=name, created=engine.started_at, owned_by="vbatch")
    return Model(id=name, created=engine.started_at, owned_by="vbatch", parent=adapter.parent)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        401: {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}},
    },
)
def metrics(registry: MetricsDep, engine: EngineDep, db: DbDep, owner: OwnerDep) -> Response:
    """Prometheus text format: the engine's `vllm:` series and vbatch's (`vbatch_*`). Needs a key when keys are
    configured: the service-wide series count every tenant's work, a series about one batch (`batch_id`) is there
    only for the caller's own batches, one about a key's online requests (`key`) only for the caller's key."""
    text = registry.exposition(
        engine.metrics_text(),
        shown=lambda ids: batches.owned(db=db, batch_ids=ids, owner=owner),
        key=key_label(owner),
    )
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@router.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
def health(engine: EngineDep, settings: SettingsDep, storage: StorageDep, db: DbDep) -> JSONResponse:
    """Everything: the engine's state and every problem of the database, the disk and the engine loop."""
    status = health_status(engine, settings, storage, db)
    return JSONResponse(status.model_dump(), status_code=200 if status.status == "ok" else 503)


@router.get("/health/ready", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
def ready(engine: EngineDep, settings: SettingsDep, storage: StorageDep, db: DbDep) -> JSONResponse:
    """For a load balancer or Kubernetes' readinessProbe: 200 only while batches can be taken and run (a working
    engine, a database that takes writes, room on the disk)."""
    return health(engine, settings, storage, db)


@router.get("/health/live", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
def live(engine: EngineDep) -> JSONResponse:
    """For Kubernetes' livenessProbe: 503 only when restarting the process is what helps, an engine that could not
    be started again; a full disk or a locked database is not (a restart would not fix them)."""
    status = HealthStatus(status=engine.state, model=engine.model_name)
    return JSONResponse(status.model_dump(), status_code=503 if engine.state == "down" else 200)


def health_status(engine: EngineView, settings: Settings, storage: Storage, db: Engine) -> HealthStatus:
    problems = [
        problem
        for problem in (
            write_problem(db),
            _disk_problem(storage.free_bytes(), settings.min_free_disk_bytes),
            None if storage.reserve.held else "the disk filled up: its reserve is released until there is room again",
            engine.scheduler_error,
        )
        if problem is not None
    ]
    state = "unavailable" if engine.state == "ok" and problems else engine.state
    return HealthStatus(status=state, model=engine.model_name, problems=problems)


def _disk_problem(free: int, minimum: int) -> str | None:
    if free >= minimum:
        return None
    return f"the data directory has {free} bytes free, under the {minimum} needed (VBATCH_MIN_FREE_DISK_BYTES)"
