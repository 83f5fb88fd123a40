"""The rule for blocking work (`app.core.blocking`): a synchronous database or object-store call on a thread that runs
an event loop raises while the guard is on, as it is for this whole suite; on a thread of its own it goes through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import SimpleNamespace

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from app.core import blocking
from app.core.blocking import BlockingOnLoop, guard_on, refuse_on_loop
from app.core.config import Settings
from app.core.db import make_engine, session_scope
from app.core.object_storage import ObjectStorage
from app.engine.batch.runs import Runs
from app.engine.scheduling import scheduler as scheduler_module
from app.engine.scheduling.scheduler import Scheduler

pytestmark = [pytest.mark.both_backends, pytest.mark.blocking_expected]


def test_the_suite_runs_with_the_guard_on_and_production_without_it():
    assert Settings().guard_blocking and guard_on()  # tests/conftest.py; servers the tests start inherit it
    assert Settings.model_fields["guard_blocking"].default is False


def _read_one(db: Engine) -> int:
    with session_scope(db) as session:
        return session.execute(text("SELECT 1")).scalar_one()


async def _read_on_the_loop(db: Engine) -> int:
    return _read_one(db)


async def _read_on_a_thread(db: Engine) -> int:
    return await asyncio.to_thread(_read_one, db)


def test_a_session_opened_on_an_event_loop_raises(settings):
    db = make_engine(settings.database)
    try:
        with pytest.raises(BlockingOnLoop, match="on a thread running an event loop"):
            asyncio.run(_read_on_the_loop(db))
    finally:
        db.dispose()


def test_a_session_on_a_thread_of_its_own_goes_through(settings):
    db = make_engine(settings.database)
    try:
        assert asyncio.run(_read_on_a_thread(db)) == 1
        assert _read_one(db) == 1  # no loop at all
    finally:
        db.dispose()


def test_the_apps_database_is_guarded(client):
    """The engine the app serves with is `make_engine`'s, guard included."""
    with pytest.raises(BlockingOnLoop):
        asyncio.run(_read_on_the_loop(client.app.state.db))
    assert _read_one(client.app.state.db) == 1


def test_a_blocking_object_store_call_on_an_event_loop_raises(s3, tmp_path):
    storage = ObjectStorage(s3.new_url(), tmp_path / "scratch")

    async def on_the_loop() -> bool:
        return storage.exists("file-nothing")

    async def on_a_thread() -> bool:
        return await asyncio.to_thread(storage.exists, "file-nothing")

    with pytest.raises(BlockingOnLoop, match=r"obstore\.head"):
        asyncio.run(on_the_loop())
    assert asyncio.run(on_a_thread()) is False


def test_a_refusal_is_recorded_whoever_catches_it():
    """What the suite's conftest reads to fail a test during which a refusal was caught."""
    before = len(blocking.raised)

    async def caught() -> None:
        with contextlib.suppress(BlockingOnLoop):
            refuse_on_loop("obstore.head")

    asyncio.run(caught())
    assert blocking.raised[before:] == ["obstore.head"]


def test_a_batch_run_that_blocks_its_loop_is_logged_as_the_bug_it_is(monkeypatch):
    async def blocks(ctx, batch_id, lease) -> None:
        refuse_on_loop("write_scope")

    monkeypatch.setattr(scheduler_module, "run_batch", blocks)
    runs = Runs()
    scheduler = Scheduler(
        engine=None, runs=runs, holder=None, bridge=SimpleNamespace(wake=lambda: None), worker_state=None
    )  # type: ignore[arg-type]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("vbatch.engine").addHandler(handler)
    try:
        asyncio.run(scheduler._run_one(None, "batch_x"))  # type: ignore[arg-type]
    finally:
        logging.getLogger("vbatch.engine").removeHandler(handler)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.CRITICAL, "batch batch_x: a blocking call on the engine's loop")
    ]
    assert records[0].exc_info is not None and isinstance(records[0].exc_info[1], BlockingOnLoop)
