"""What routes need, as Annotated dependencies. Everything hangs off app.state, set up by app.main."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.engine import Engine

from app.config import Settings
from app.engine.service import EngineService
from app.storage import Storage


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _db(request: Request) -> Engine:
    return request.app.state.db


def _storage(request: Request) -> Storage:
    return request.app.state.storage


def _engine(request: Request) -> EngineService:
    return request.app.state.engine


SettingsDep = Annotated[Settings, Depends(_settings)]
DbDep = Annotated[Engine, Depends(_db)]
StorageDep = Annotated[Storage, Depends(_storage)]
EngineDep = Annotated[EngineService, Depends(_engine)]
