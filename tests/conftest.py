"""Shared fixtures. Unit tests run the real app on a real SQLite file with a fake engine; a module that sets
`pytestmark = pytest.mark.both_backends` (or a test marked so) runs each of its tests that reach the `backend`
fixture on both shapes: SQLite and the data directory, and Postgres (PyPI's `pgserver`) with an S3 store (moto's
server), each started once per session. A test may parametrize `backend` itself ("postgres" alone: Postgres with the
data directory). End-to-end tests (tests/e2e) start the real `vbatch serve` once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FakeEngine, LocalPostgres, LocalS3

# TestClient's requests name the host "testserver", which the Host rule (`app.api.guard.HostRule`) would refuse.
os.environ.setdefault("VBATCH_ALLOWED_HOSTS", "testserver")
# A blocking database or object-store call on an event loop raises (`app.core.blocking`), here and in every server the
# tests start as a process of its own.
os.environ["VBATCH_GUARD_BLOCKING"] = "true"
# A small disk reserve in every server process the tests start (their data directories, 32 MiB each by default, took
# 4.5 GiB of a run); tests of the reserve set their own.
os.environ.setdefault("VBATCH_DISK_RESERVE_BYTES", "65536")
# API replicas and workers start only with a fleet secret (`app.core.fleet`): one for every one the tests start.
os.environ.setdefault("VBATCH_FLEET_SECRET", "tests-fleet-secret-0123456789abcdef")


BOTH_BACKENDS = ("sqlite", "postgres_s3")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_backends: run on SQLite and files, and on Postgres with an S3 store")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if hasattr(metafunc.module, "BACKENDS"):
        # The header this marker replaced: left in a module, it would now run that module on SQLite alone, silently.
        raise pytest.UsageError(f"{metafunc.module.__name__}: BACKENDS is no longer read; mark it both_backends")
    # Only tests that reach `backend`: a module's pure unit tests keep running once.
    if metafunc.definition.get_closest_marker("both_backends") and "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BOTH_BACKENDS, indirect=True)


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
    """None: the default SQLite file in the data directory."""
    if backend == "sqlite":
        return None
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture
def storage_url(request, backend: str) -> str | None:
    """None: the data directory's files."""
    return request.getfixturevalue("s3").new_url() if backend == "postgres_s3" else None


@pytest.fixture
def settings(tmp_path: Path, database_url: str | None, storage_url: str | None) -> Settings:
    # A small disk reserve: every test starts an app, and each would write the default 32 MiB.
    return Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        storage_url=storage_url,
        completion_windows="24h,2s",
        checkpoint_seconds=0.05,
        disk_reserve_bytes=65536,
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
