"""The fixtures the integration tier (and e2e, for Postgres and S3) shares: the real app on a real SQLite file with a
fake engine, `backend` (SQLite and the data directory, or Postgres (PyPI's `pgserver`) with an S3 store (moto's
server), each started once per session). A tier's conftest imports the ones it uses; the unit tier imports none."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.db import sqlite_path
from app.core.migrate import upgrade_to_head
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine, LocalPostgres, LocalS3


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> Iterator[LocalPostgres]:
    server = LocalPostgres(tmp_path_factory.mktemp("pg"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[LocalS3]:
    """Its AWS_* variables hold for the whole session: apps in this process and the processes tests start."""
    server = LocalS3(tmp_path_factory.mktemp("s3") / "moto.log")
    saved = {name: os.environ.get(name) for name in server.environ}
    os.environ.update(server.environ)
    yield server
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


@pytest.fixture
def backend(request) -> str:
    return getattr(request, "param", "sqlite")


@pytest.fixture
def database_url(request, backend: str) -> str | None:
    """None: the default SQLite file in the data directory. Either starts at the head revision (`settings`)."""
    if backend == "sqlite":
        return None
    return request.getfixturevalue("postgres").new_database(migrated=True)


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory) -> Path:
    """A SQLite file migrated to the head revision once a session: each test's database starts as a copy of it, as
    a restarted vbatch finds its own (every migration run again took 0.2 s of each test's app start)."""
    path = tmp_path_factory.mktemp("migrated") / "vbatch.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture
def storage_url(request, backend: str) -> str | None:
    """None: the data directory's files."""
    return request.getfixturevalue("s3").new_url() if backend == "postgres_s3" else None


@pytest.fixture
def settings(tmp_path: Path, database_url: str | None, storage_url: str | None, migrated_sqlite: Path) -> Settings:
    # A small disk reserve: every test starts an app, and each would write the default 32 MiB.
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        storage_url=storage_url,
        completion_windows="24h,2s",
        checkpoint_seconds=0.05,
        disk_reserve_bytes=65536,
    )
    if database_url is None:
        database = sqlite_path(settings.database)
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(migrated_sqlite, database)
    return settings


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


@pytest.fixture
def runner_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog`, hearing what batch runs log too: `vbatch.runner` has its own handler and does not propagate."""
    runner = logging.getLogger("vbatch.runner")
    runner.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        runner.removeHandler(caplog.handler)
