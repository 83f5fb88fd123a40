"""What routes need, as Annotated dependencies. Everything hangs off app.state, set up by app.main."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine

from app.api.guard import FORWARDED_TENANT
from app.core.config import Settings
from app.core.storage import Storage
from app.domain.estimate_slots import EstimateSlots
from app.engine.online.view import EngineView
from app.engine.telemetry.metrics import Metrics


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _db(request: Request) -> Engine:
    return request.app.state.db


def _storage(request: Request) -> Storage:
    return request.app.state.storage


def _engine(request: Request) -> EngineView:
    return request.app.state.engine


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def _estimate_slots(request: Request) -> EstimateSlots:
    return request.app.state.estimate_slots


# Declared for the OpenAPI document (and so clients see the scheme); KeyRing reads the header itself.
_bearer = HTTPBearer(auto_error=False, description="An API key from VBATCH_API_KEYS or VBATCH_API_KEYS_FILE.")


def _owner(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]) -> str:
    """The key's owner id; for an online request an API replica forwarded, the tenant its signature names
    (`app.api.guard`)."""
    forwarded = request.scope.get("state", {}).get(FORWARDED_TENANT)
    if forwarded is not None:
        return forwarded
    return request.app.state.keys.owner(request.headers.get("authorization"))


SettingsDep = Annotated[Settings, Depends(_settings)]
DbDep = Annotated[Engine, Depends(_db)]
StorageDep = Annotated[Storage, Depends(_storage)]
EngineDep = Annotated[EngineView, Depends(_engine)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
EstimateSlotsDep = Annotated[EstimateSlots, Depends(_estimate_slots)]
# The caller's owner id; resolving it authenticates the request (401 otherwise).
OwnerDep = Annotated[str, Depends(_owner)]
