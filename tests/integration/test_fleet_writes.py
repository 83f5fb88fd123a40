"""What a fleet's workers write, counted (issue 41): every lease renewed in one statement and only once a third of a
lease has passed, a look for work that reads the batches its service holds and no others, a checkpoint that is one
statement (which also renews the lease and says whether a cancel came), a beat that is one statement, and claims
that go round robin over keys."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from app.core.db import make_engine, session_scope
from app.core.ids import new_id
from app.domain import batches, leases, workers
from app.domain.batches import Progress
from app.domain.leases import LeaseLost
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow, FileRow
from app.domain.schemas import CreateBatchRequest
from app.domain.workers import WorkerState
from app.engine.batch.runs import Runs
from app.engine.scheduling.holder import REREAD_SECONDS, LeaseHolder
from app.testing import add_running_batches
from tests.helpers import app_on

pytestmark = pytest.mark.both_backends


@pytest.fixture
def db(settings, backend):
    with app_on(settings):  # migrated to head
        pass
    engine = make_engine(settings.database)
    yield engine
    engine.dispose()


@contextmanager
def sent(db) -> Iterator[list[str]]:
    """The statements `db` sends meanwhile (SQLite's BEGIN IMMEDIATE aside: Postgres begins without one)."""
    seen: list[str] = []

    def after(_conn, _cursor, statement, _parameters, _context, _executemany) -> None:
        if not statement.lstrip().upper().startswith("BEGIN"):
            seen.append(statement)

    event.listen(db, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        event.remove(db, "after_cursor_execute", after)


@contextmanager
def rows_read() -> Iterator[list[str]]:
    """The ids of the batch rows any session loads meanwhile."""
    loaded: list[str] = []

    def on_load(_session, instance) -> None:
        if isinstance(instance, BatchRow):
            loaded.append(instance.id)

    event.listen(Session, "loaded_as_persistent", on_load)
    try:
        yield loaded
    finally:
        event.remove(Session, "loaded_as_persistent", on_load)


def test_every_lease_is_renewed_in_one_statement(db):
    add_running_batches(db, 3)
    held = leases.claim(db=db, holder="h", seconds=30)
    with sent(db) as statements:
        assert leases.renew(db=db, leases=held, seconds=60) == set()
    assert len(statements) == 1
    [taken_over] = leases.claim(db=db, holder="other", seconds=30, limit=1) or [None]
    assert taken_over is None  # renewed: none has run out
    stale = [*held[:2], leases.Lease(held[2].batch_id, held[2].holder, held[2].token - 1)]
    assert leases.renew(db=db, leases=stale, seconds=60) == {held[2].batch_id}


def test_a_look_for_work_renews_once_a_third_of_a_lease_has_passed_and_reads_only_its_own_batches(db, settings):
    settings = settings.model_copy(update={"lease_seconds": 30.0})
    add_running_batches(db, 40)  # a queue: the fleet's other batches
    holder = LeaseHolder(Runs(), serves=lambda: ["fake-model"])
    holder.hold_at_most = 2
    with rows_read() as loaded:
        held = asyncio.run(holder.hold(db, settings))  # it claims two, and reads those two
    assert len(held) == 2 and sorted(loaded) == sorted([row.id for row in held] * 2)  # the claim's and the look's
    with sent(db) as statements:
        assert asyncio.run(holder.hold(db, settings)) == held  # full, renewed and read a moment ago: nothing to send
    assert statements == []
    holder._renewed_at = time.monotonic() - 11  # a third of the lease ago
    with sent(db) as statements:
        asyncio.run(holder.hold(db, settings))
    assert [sql.lstrip().split()[0].upper() for sql in statements] == ["UPDATE"]  # every lease in one
    holder._read_at = time.monotonic() - REREAD_SECONDS
    with sent(db) as statements, rows_read() as loaded:
        asyncio.run(holder.hold(db, settings))
    assert len(statements) == 1 and sorted(loaded) == sorted(row.id for row in held)  # its own two, none other
    holder.runs.ended += 1  # a run has ended: its batch may have
    with sent(db) as statements:
        asyncio.run(holder.hold(db, settings))
    assert len(statements) == 1


def test_a_checkpoint_is_one_statement_that_renews_the_lease_and_reports_a_cancel(db):
    [batch_id] = add_running_batches(db, 1)
    [lease] = leases.claim(db=db, holder="h", seconds=5)
    before = batches.get(db=db, batch_id=batch_id, owner=None).lease_expires_ns
    with sent(db) as statements:
        status = batches.save_checkpoint(
            db=db, batch_id=batch_id, progress=Progress(completed=3), output_bytes=30, error_bytes=0, lease=lease,
            lease_seconds=60,
        )  # fmt: skip
    assert (status, len(statements)) == (BatchStatus.IN_PROGRESS, 1)
    row = batches.get(db=db, batch_id=batch_id, owner=None)
    assert (row.completed, row.output_bytes_done, row.parts_token) == (3, 30, lease.token)
    assert row.lease_expires_ns is not None and before is not None and row.lease_expires_ns > before + 50 * 10**9
    batches.transition(db=db, batch_id=batch_id, to=BatchStatus.CANCELLING)
    status = batches.save_checkpoint(
        db=db, batch_id=batch_id, progress=Progress(completed=4), output_bytes=40, error_bytes=0, lease=lease
    )
    assert status == BatchStatus.CANCELLING
    leases.renew(db=db, leases=[lease], seconds=-1)  # run out
    [other] = leases.claim(db=db, holder="other", seconds=30)
    assert other.batch_id == batch_id
    with pytest.raises(LeaseLost):
        batches.save_checkpoint(
            db=db, batch_id=batch_id, progress=Progress(completed=9), output_bytes=90, error_bytes=0, lease=lease
        )
    assert batches.get(db=db, batch_id=batch_id, owner=None).completed == 4


def test_a_beat_is_one_statement_once_the_worker_has_a_row(db):
    worker = WorkerState(
        holder="w", started_at=1, state="ok", served_models=["m"], engine_config={}, scheduler_error=None,
        engine_deaths=0,
    )  # fmt: skip
    workers.beat(db=db, worker=worker)
    with sent(db) as statements:
        workers.beat(db=db, worker=worker)
    assert len(statements) == 1
    assert [seen.served_models for seen in workers.seen(db=db, within_seconds=10) if seen.holder == "w"] == [["m"]]


def create(db, owner: str) -> str:
    """A batch of `owner` created as its replica would, on a file of its own."""
    with session_scope(db) as session:
        file = FileRow(id=new_id("file-"), created_ns=time.time_ns(), created_at=int(time.time()), bytes=1,
                       filename="in.jsonl", purpose="batch", owner=owner)  # fmt: skip
        session.add(file)
        session.commit()
    request = CreateBatchRequest(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    return batches.create(db=db, request=request, windows={"24h": 86400}, owner=owner, max_active=0).id


def test_claims_go_round_robin_over_keys_and_a_late_key_waits_behind_no_backlog(db):
    made = [(owner, create(db, owner)) for owner in ["a", "a", "a", "b", "a", "c"]]
    owner_of = {batch_id: owner for owner, batch_id in made}

    def claim_next(count: int) -> list[str]:
        return [owner_of[lease.batch_id] for lease in leases.claim(db=db, holder="h", seconds=60, limit=count)]

    assert claim_next(3) == ["a", "b", "c"]  # each key's first, before any key's second
    owner_of[create(db, "d")] = "d"  # a newcomer: in the turn claims have reached, not behind a's backlog
    assert claim_next(3) == ["a", "d", "a"]
    assert claim_next(3) == ["a"]
