"""A fleet's connections to Postgres (issue 41): each process's pool is bounded, its claim on the database does not
take one of the pool's, a connection in steady use costs no ping (one idle a while does, and one the server closed
is replaced); and through PgBouncer in transaction mode (`VBATCH_DATABASE_POOLER=transaction`), where no server
connection is a process's own, statements are not prepared, the claim is checked rather than held, and a worker,
which cannot LISTEN there, looks for work four times a second while it has room, and runs the batches it finds."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from app.core import db as db_module
from app.core.db import DatabaseTaken, claim_database, hears_announcements, make_engine
from app.core.migrate import upgrade_to_head
from app.engine.batch.runs import Runs
from app.engine.online.view import WorkersView
from app.engine.scheduling.holder import LeaseHolder
from app.engine.scheduling.scheduler import POLL_SECONDS, UNANNOUNCED_POLL_SECONDS, Scheduler
from app.engine.service import EngineService
from app.main import Role, create_app
from app.testing import FakeEngine, LocalPgBouncer, LocalPostgres
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_status


@pytest.fixture(scope="module")
def pgbouncer(postgres: LocalPostgres, tmp_path_factory) -> Iterator[LocalPgBouncer]:
    bouncer = LocalPgBouncer(tmp_path_factory.mktemp("pgbouncer"), postgres, server_connections=4)
    yield bouncer
    bouncer.stop()


def server_connections(url: str) -> int:
    """Connections the server has open to this URL's database, but the one asking."""
    plain = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return row[0]


def hold_connections(engine, count: int) -> tuple[list[threading.Thread], threading.Event, threading.Event]:
    """`count` threads that each take a connection and keep it until `release` is set; `two_in` once two have one."""
    release, two_in = threading.Event(), threading.Event()
    inside = []

    def hold() -> None:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
            inside.append(1)
            if len(inside) >= 2:
                two_in.set()
            release.wait(30)

    threads = [threading.Thread(target=hold) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, release, two_in


def test_a_process_opens_no_more_connections_than_its_pool_size_and_its_claim_takes_none_of_them(postgres, tmp_path):
    url = postgres.new_database()
    engine = make_engine(url, pool_size=2)
    claim = claim_database(engine, tmp_path, exclusive=False)
    try:
        assert engine.pool.checkedout() == 0  # the claim holds a connection of its own
        threads, release, two_in = hold_connections(engine, 5)
        assert two_in.wait(10)
        assert server_connections(url) == 3  # two of the pool's, and the claim's; the other three threads wait
        release.set()
        for thread in threads:
            thread.join(30)
    finally:
        claim.close()
        engine.dispose()


def test_a_connection_in_steady_use_is_not_pinged_and_one_closed_while_idle_is_replaced(postgres, monkeypatch):
    url = postgres.new_database()
    engine = make_engine(url, pool_size=1)
    pings = []
    real_ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda connection: pings.append(1) or real_ping(connection))
    try:
        for _ in range(5):
            with engine.connect() as connection:
                backend = connection.execute(text("SELECT pg_backend_pid()")).scalar()
        assert pings == []
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s, 5000)", (backend,))  # the server closes it, idle in the pool
        monkeypatch.setattr(db_module, "PING_IDLE_SECONDS", 0.0)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT pg_backend_pid()")).scalar() != backend
        assert pings
    finally:
        engine.dispose()


def test_through_pgbouncer_statements_are_not_prepared(postgres, pgbouncer):
    url = pgbouncer.url(postgres.new_database())
    engine = make_engine(url, pool_size=4, pooler="transaction")
    failures: list[Exception] = []

    def repeat() -> None:
        try:  # psycopg prepares a statement at its sixth run: a pooler hands each run any server connection
            for n in range(30):
                with engine.connect() as connection:
                    assert connection.execute(text("SELECT CAST(:n AS integer) + 1"), {"n": n}).scalar() == n + 1
                    connection.commit()
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=repeat) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failures == []
        assert not hears_announcements(engine)  # no LISTEN through it
    finally:
        engine.dispose()


def test_through_pgbouncer_the_claim_on_the_database_is_checked_not_held(postgres, pgbouncer, tmp_path):
    direct = postgres.new_database()
    pooled = make_engine(pgbouncer.url(direct), pooler="transaction")
    alone = make_engine(direct)
    try:
        claim_database(pooled, tmp_path, exclusive=False).close()
        with alone.connect() as connection:
            held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            assert connection.execute(text(held)).scalar() == 0
        serve = claim_database(alone, tmp_path, exclusive=True)  # `vbatch serve` holds it alone
        try:
            with pytest.raises(DatabaseTaken):
                claim_database(pooled, tmp_path, exclusive=False)
        finally:
            serve.close()
    finally:
        pooled.dispose()
        alone.dispose()


def test_a_worker_that_cannot_listen_looks_four_times_a_second_while_it_has_room(postgres, pgbouncer):
    direct = postgres.new_database()
    pooled = make_engine(pgbouncer.url(direct), pooler="transaction")
    alone = make_engine(direct)
    holder = LeaseHolder(Runs(), serves=lambda: [])
    scheduler = Scheduler(engine=None, runs=holder.runs, holder=holder, bridge=None, worker_state=None)  # type: ignore[arg-type]
    try:
        holder.hold_at_most = 2
        assert scheduler._next_look(pooled) == UNANNOUNCED_POLL_SECONDS
        assert scheduler._next_look(alone) == POLL_SECONDS  # it hears of new work as it commits
        holder.hold_at_most = 0  # full: nothing to claim until a batch ends, which it sees itself
        assert scheduler._next_look(pooled) == POLL_SECONDS
    finally:
        pooled.dispose()
        alone.dispose()


def test_a_worker_through_pgbouncer_runs_batches_a_replica_creates(postgres, pgbouncer, settings):
    direct = postgres.new_database()
    upgrade_to_head(direct)
    # One host: the two share the data directory's files (no S3 here).
    api_settings = settings.model_copy(update={"database_url": direct})
    worker_settings = settings.model_copy(
        update={"database_url": pgbouncer.url(direct), "database_pooler": "transaction"}
    )
    worker_app = create_app(worker_settings, EngineService(FakeEngine()), Role.WORKER)
    with TestClient(create_app(api_settings, WorkersView(), Role.API)) as replica, TestClient(worker_app) as worker:
        for name in ("a", "b"):
            source = upload(replica, jsonl([request_line(f"{name}{i}") for i in range(6)]))
            batch = create_batch(replica, source["id"])
            done = wait_status(replica, batch["id"], {"completed"}, timeout=30)
            answered = sorted(line["custom_id"] for line in read_jsonl(replica, done["output_file_id"]))
            assert answered == sorted(f"{name}{i}" for i in range(6))
        assert worker.get("/health").json()["status"] == "ok"
