"""SQLite engine and sessions. WAL with synchronous=FULL so a committed row survives a crash."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, create_engine

BUSY_TIMEOUT_MS = 10_000
_IMMEDIATE = "vbatch_immediate"


def _on_connect(dbapi_connection, _record) -> None:
    # pysqlite's own transaction handling would BEGIN lazily and DEFERRED; we emit BEGIN ourselves.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.close()


def _on_begin(connection) -> None:
    immediate = connection.get_execution_options().get(_IMMEDIATE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_engine(path: Path) -> Engine:
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _on_connect)
    event.listen(engine, "begin", _on_begin)
    return engine


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A read (or simple insert) session."""
    with Session(engine, expire_on_commit=False) as session:
        yield session


@contextmanager
def write_scope(engine: Engine) -> Iterator[Session]:
    """A read-modify-write session: BEGIN IMMEDIATE takes the write lock first, so two writers never interleave."""
    with Session(engine.execution_options(**{_IMMEDIATE: True}), expire_on_commit=False) as session:
        yield session


def write_problem(path: Path) -> str | None:
    """Why the database cannot take a write now (read-only, full disk, unreadable), or None. A writer holding the
    lock is no problem: the check waits for nobody."""
    try:
        connection = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=0, isolation_level=None)
    except sqlite3.Error as exc:
        return f"the database cannot be opened ({exc})"
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
    except sqlite3.Error as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return None
        return f"the database cannot be written ({exc})"
    finally:
        connection.close()
    return None
