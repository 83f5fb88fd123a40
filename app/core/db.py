"""The database engine and sessions, by URL: SQLite (the default; WAL with synchronous=FULL so a committed row
survives a crash, and one writer at a time) or Postgres (row locks where a write reads first, advisory locks where
what must not change is a row that does not exist yet)."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Literal, Protocol

from sqlalchemy import NullPool, event, text
from sqlalchemy.engine import Dialect, Engine, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, SQLAlchemyError
from sqlmodel import Session, create_engine

from app.core.blocking import guard_on, refuse_on_loop

BUSY_TIMEOUT_MS = 10_000
CONNECT_TIMEOUT_S = 5
_IMMEDIATE = "vbatch_immediate"
WORK_CHANNEL = "vbatch_work"
# Connections a process's pool opens at most unless told (`VBATCH_DATABASE_POOL_SIZE`).
DEFAULT_POOL_SIZE = 5
# A pooled connection idle longer than this is pinged before it is used: the server may have closed it meanwhile (a
# restart, a failover). One in steady use is not, which saves a round trip on every transaction.
PING_IDLE_SECONDS = 5.0
# `VBATCH_DATABASE_POOLER`: how the URL reaches Postgres, directly or through a pooler in transaction mode.
Pooler = Literal["none", "transaction"]
_BEHIND_POOLER: weakref.WeakSet[Engine] = weakref.WeakSet()


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


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> Path:
    database = make_url(url).database
    assert database, f"{url} names no SQLite file"
    return Path(database)


def make_engine(url: str, *, pool_size: int = DEFAULT_POOL_SIZE, pooler: Pooler = "none") -> Engine:
    """On Postgres, a pool of at most `pool_size` connections (a thread that finds them all taken waits for one):
    each process opens that many at most, whatever its load, so a fleet's connections add up to a known number.
    `pooler="transaction"`: the URL reaches Postgres through a pooler in transaction mode (PgBouncer), which hands
    each transaction whichever server connection is free."""
    if not is_sqlite(url):
        connect_args: dict[str, object] = {"connect_timeout": CONNECT_TIMEOUT_S}
        if pooler == "transaction":
            # psycopg prepares a statement it has run five times, on the server connection it ran on; the next
            # transaction may run on another, which knows no such statement.
            connect_args["prepare_threshold"] = None
        engine = create_engine(url, pool_size=pool_size, max_overflow=0, connect_args=connect_args)
        event.listen(engine, "checkin", _on_checkin)
        event.listen(engine, "checkout", partial(_ping_if_idle, engine.dialect))
        if pooler == "transaction":
            _BEHIND_POOLER.add(engine)
    else:
        sqlite_path(url).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _on_connect)
        event.listen(engine, "begin", _on_begin)
    if guard_on():
        event.listen(engine, "checkout", _on_checkout)
    return engine


def _on_checkout(_dbapi_connection, _record, _proxy) -> None:
    refuse_on_loop("a database connection taken from the pool")


def _on_checkin(_dbapi_connection, record) -> None:
    record.info["returned_at"] = time.monotonic()


def _ping_if_idle(dialect: Dialect, dbapi_connection, record, _proxy) -> None:
    """A connection the server closed while it sat idle in the pool is replaced before use, not failed on: the pool
    takes another (SQLAlchemy's `pool_pre_ping`, but only after `PING_IDLE_SECONDS` idle)."""
    returned = record.info.get("returned_at")
    if returned is None or time.monotonic() - returned < PING_IDLE_SECONDS:
        return
    try:
        dialect.do_ping(dbapi_connection)
    except dialect.loaded_dbapi.Error as exc:
        raise DisconnectionError(f"a pooled connection was closed while idle: {exc}") from exc


def behind_pooler(engine: Engine) -> bool:
    """Whether `engine` reaches Postgres through a pooler in transaction mode: no session of its own (LISTEN, session
    locks), one transaction at a time on whichever server connection is free."""
    return engine in _BEHIND_POOLER


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A read (or simple insert) session."""
    with Session(engine, expire_on_commit=False) as session:
        yield session


@contextmanager
def write_scope(engine: Engine) -> Iterator[Session]:
    """A read-modify-write session. On SQLite BEGIN IMMEDIATE takes the write lock first, so two writers never
    interleave; on Postgres each read that a write depends on locks its row (`with_for_update`, ignored by
    SQLite) or takes `lock_name`."""
    with Session(engine.execution_options(**{_IMMEDIATE: True}), expire_on_commit=False) as session:
        yield session


def lock_name(session: Session, name: str) -> None:
    """Hold `name` until the transaction ends: for a rule over rows that may not exist yet (a count, a unique
    choice). SQLite's write lock already covers it; Postgres takes an advisory transaction lock."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:name, 0))"), {"name": name})


def announce_work(session: Session) -> None:
    """Tell the workers of other processes to look for work once this transaction commits (a batch created,
    cancelled or cut into shards): Postgres NOTIFY. On SQLite they find it at their next poll."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": WORK_CHANNEL})


def hears_announcements(engine: Engine) -> bool:
    """Whether `work_announcements` yields anything: on Postgres reached directly. SQLite announces nothing, and a
    pooler in transaction mode carries no LISTEN (the server connection that listened goes back to its pool after
    the statement)."""
    return engine.dialect.name == "postgresql" and not behind_pooler(engine)


async def work_announcements(engine: Engine) -> AsyncIterator[None]:
    """Yields once listening (work announced meanwhile was missed: look now), then at each `announce_work`
    committed anywhere, where it `hears_announcements` (else it ends at once). Raises when the connection fails:
    listen again."""
    if not hears_announcements(engine):
        return
    import psycopg

    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn:
        await conn.execute(f"LISTEN {WORK_CHANNEL}")
        yield
        async for _ in conn.notifies():
            yield


class DatabaseTaken(RuntimeError):
    pass


class Claim(Protocol):
    def close(self) -> None: ...


def claim_database(engine: Engine, data_dir: Path, *, exclusive: bool) -> Claim:
    """This process's claim on the database, held until `close`: `vbatch serve` claims it alone (`exclusive`: it
    sweeps what no row refers to and expects no other process beside it), API replicas and workers together. A
    lock on the server for Postgres, on a connection of its own (not one of the pool's), on a file beside the
    database for SQLite (whose processes share a host). Through a pooler in transaction mode a session lock would
    stay on whichever server connection took it: a replica or worker there only checks, at its start, that `vbatch
    serve` holds none."""
    where = engine.url.render_as_string(hide_password=True)
    if engine.dialect.name == "sqlite":
        lock = (data_dir / "service.lock").open("a")
        try:
            fcntl.flock(lock, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise DatabaseTaken(_taken_message(where, exclusive)) from None
        return lock
    if behind_pooler(engine):
        with engine.connect() as checking:
            free = checking.execute(text(f"SELECT pg_try_advisory_xact_lock{_shared(exclusive)}({_SERVICE_LOCK})"))
            if not free.scalar():
                raise DatabaseTaken(_taken_message(where, exclusive))
        return _NoClaim()
    own = create_engine(engine.url, poolclass=NullPool, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    connection = own.connect()
    taken = connection.execute(text(f"SELECT pg_try_advisory_lock{_shared(exclusive)}({_SERVICE_LOCK})")).scalar()
    connection.commit()
    if not taken:
        connection.close()
        raise DatabaseTaken(_taken_message(where, exclusive))
    return connection


_SERVICE_LOCK = "hashtextextended('vbatch-service', 0)"


def _shared(exclusive: bool) -> str:
    return "" if exclusive else "_shared"


class _NoClaim:
    def close(self) -> None:
        pass


def _taken_message(where: str, exclusive: bool) -> str:
    if exclusive:
        return (
            f"another vbatch process already runs on {where}: `vbatch serve` runs alone "
            "(for several processes, run `vbatch api` and `vbatch worker`)"
        )
    return f"`vbatch serve` already runs on {where}: API replicas and workers run beside each other, not beside it"


def write_problem(engine: Engine) -> str | None:
    """Why the database cannot take a write now (read-only, full disk, unreachable), or None. A writer holding
    the lock is no problem: the check waits for nobody."""
    refuse_on_loop("write_problem")  # on SQLite it opens a connection of its own, outside the pool
    if engine.dialect.name == "sqlite":
        return _sqlite_write_problem(Path(engine.url.database or ""))
    try:
        with engine.connect() as connection:
            read_only = connection.execute(text("SHOW transaction_read_only")).scalar()
    except SQLAlchemyError as exc:
        return f"the database cannot be reached ({type(exc).__name__})"
    return "the database takes no writes (a read-only server or replica)" if read_only == "on" else None


def unavailable_reason(exc: DBAPIError) -> str | None:
    """Why a statement failed for the state of the database rather than for the statement (it takes no writes),
    or None."""
    orig = exc.orig
    if isinstance(orig, sqlite3.Error):
        readonly = getattr(orig, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_READONLY
        return "the database takes no writes: it is read-only for this process" if readonly else None
    if getattr(orig, "sqlstate", None) == "25006":  # read_only_sql_transaction
        return "the database takes no writes: a read-only server or replica"
    return None


def _sqlite_write_problem(path: Path) -> str | None:
    unwritable = _unwritable_sqlite_file(path)
    if unwritable is not None:
        return f"the database takes no writes: {unwritable} is not writable by this process"
    try:
        connection = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=0, isolation_level=None)
    except sqlite3.Error as exc:
        return f"the database cannot be opened ({exc})"
    try:
        # SQLite opens a file it may not write read-only without a word, and BEGIN IMMEDIATE writes nothing: only
        # a write finds out. It is rolled back, so nothing reaches the file.
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("CREATE TABLE vbatch_write_probe (x)")
        connection.execute("ROLLBACK")
    except sqlite3.Error as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return None
        if exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_READONLY:
            return f"the database takes no writes ({exc})"
        return f"the database cannot be written ({exc})"
    finally:
        connection.close()
    return None


def _unwritable_sqlite_file(path: Path) -> Path | None:
    """The database, its WAL files or its directory (where SQLite makes them), if one is not writable."""
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return path.parent
    for file in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
        if file.exists() and not os.access(file, os.W_OK):
            return file
    return None
