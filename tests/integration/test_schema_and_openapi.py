"""The database schema Alembic builds equals the models; openapi.yaml equals what the app serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text
from sqlmodel import SQLModel

import app.domain.models  # noqa: F401
from app.core.migrate import upgrade_to_head
from app.openapi import served_openapi

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.both_backends


@pytest.fixture
def empty_database(request, backend: str, tmp_path: Path) -> str:
    """Empty, where `settings`' database starts as a copy of one migrated once (tests/fixtures.py)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("postgres").new_database()


def test_migrations_reach_the_models(empty_database: str):
    upgrade_to_head(empty_database)
    upgrade_to_head(empty_database)  # a second start finds nothing to do
    engine = create_engine(empty_database)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}), SQLModel.metadata)
    assert diff == []
    if engine.dialect.name == "postgresql":  # what overflowed a 32-bit INTEGER
        with engine.connect() as connection:
            kind = connection.execute(
                text(
                    "SELECT data_type FROM information_schema.columns "
                    "WHERE table_name = 'batches' AND column_name = 'created_ns'"
                )
            ).scalar()
        assert kind == "bigint"


def test_migrations_would_notice_a_missing_index(tmp_path):
    path = tmp_path / "drifted.db"
    upgrade_to_head(f"sqlite:///{path}")
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP INDEX ix_files_purpose")
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
    assert diff != []


def test_openapi_yaml_is_what_the_app_serves():
    committed = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    assert committed == served_openapi(), "run `make openapi` and commit openapi.yaml"


def test_openapi_lists_every_endpoint():
    paths = served_openapi()["paths"]
    assert set(paths) == {
        "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
        "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel", "/v1/batches/{batch_id}/partial_output",
        "/v1/batches/estimate",
        "/v1/batches/{batch_id}/progress", "/v1/batches/{batch_id}/retry", "/v1/models", "/v1/models/{model}",
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/health", "/health/ready", "/health/live", "/metrics",
    }  # fmt: skip
