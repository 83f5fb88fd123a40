"""The integration tier: the real app (TestClient or a process of its own) on real SQLite/Postgres/S3 and files, with
the fake engine (`app.testing.FakeEngine`)."""

from tests.fixtures import (  # noqa: F401 - fixtures
    backend,
    client,
    database_url,
    engine_service,
    fake_engine,
    migrated_sqlite,
    postgres,
    runner_log,
    s3,
    settings,
    storage_url,
)
