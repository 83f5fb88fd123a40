"""Shared fixtures. Unit tests run the real app on a real SQLite file with a fake engine; end-to-end tests
(tests/e2e) start the real `vbatch serve` once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # A small disk reserve: every test starts an app, and each would write the default 32 MiB.
    return Settings(
        data_dir=tmp_path / "data", completion_windows="24h,2s", checkpoint_seconds=0.05, disk_reserve_bytes=65536
    )


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def engine_service(fake_engine: FakeEngine) -> EngineService:
    return EngineService(fake_engine)


@pytest.fixture
def client(settings: Settings, engine_service: EngineService) -> Iterator[TestClient]:
    with TestClient(create_app(settings, engine_service)) as test_client:
        yield test_client
