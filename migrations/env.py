"""Alembic environment. vbatch runs `upgrade head` itself at start (app.core.migrate)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text
from sqlmodel import SQLModel

import app.domain.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from app.core.config import Settings

target_metadata = SQLModel.metadata


def _url() -> str:
    return context.config.get_main_option("sqlalchemy.url") or Settings().database


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, render_as_batch=True, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url())
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":  # replicas starting together migrate one after another
                connection.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('vbatch-migrations', 0))"))
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
