"""Brings a database to the newest schema with Alembic, as `vbatch serve` does at start."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config

from app.core.blocking import refuse_on_loop
from app.core.db import is_sqlite, sqlite_path


def migrations_dir() -> Path:
    """The top-level `migrations/` ships inside the wheel as the package `app.migrations` (pyproject.toml); a source
    tree that is not installed (on PYTHONPATH, as on the GPU machine) has it beside `app/`."""
    spec = importlib.util.find_spec("app.migrations")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Alembic's config interpolates `%`; a password may hold one.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_to_head(url: str) -> None:
    """Several processes may start at once on one server database: env.py serialises them on a lock."""
    refuse_on_loop("upgrade_to_head")  # Alembic's engine is its own, outside `make_engine`'s guard
    if is_sqlite(url):
        sqlite_path(url).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), "head")
