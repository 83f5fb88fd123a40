"""Batch leases: one holder per batch, taken over when its lease runs out, and a holder that lost its lease writes
nothing (its token is refused, its part files are its own)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from app.core.db import make_engine, session_scope
from app.domain import batches, leases
from app.domain.batches import Progress
from app.domain.leases import LeaseLost
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.engine.service import EngineService
from app.testing import FakeEngine, add_running_batches
from tests.helpers import (
    app_on,
    held_batch,
    read_jsonl,
    storage_of,
    stored_names,
    wait_for,
    wait_status,
)

pytestmark = pytest.mark.both_backends


@pytest.fixture
def db(settings, backend):
    # The app's start migrates the database; a client started and stopped leaves it at head.
    with app_on(settings):
        pass
    engine = make_engine(settings.database)
    yield engine
    engine.dispose()


def test_each_batch_goes_to_one_of_many_claimers(db):
    ids = add_running_batches(db, 24)

    def claim_all(holder: str) -> list[str]:
        taken = []
        while batch := leases.claim(db=db, holder=holder, seconds=30, limit=2):
            taken += [lease.batch_id for lease in batch]
        return taken

    with ThreadPoolExecutor(4) as pool:
        taken = list(pool.map(claim_all, [f"h{i}" for i in range(4)]))
    assert Counter(batch_id for mine in taken for batch_id in mine) == Counter(ids)
    assert leases.claim(db=db, holder="late", seconds=30) == []  # all held


def test_a_lease_runs_from_when_its_batch_was_locked_not_from_before_the_wait_for_it(db, monkeypatch):
    [batch_id] = add_running_batches(db, 1)
    times = iter([1_000 * 10**9, 1_100 * 10**9])  # the claim begins; 100 s later (a pool's wait, a pause) it locks

    monkeypatch.setattr(leases.clock, "now_ns", lambda: next(times))
    assert len(leases.claim(db=db, holder="a", seconds=30)) == 1
    monkeypatch.undo()
    with session_scope(db) as session:
        row = session.get(BatchRow, batch_id)
        assert row is not None and row.lease_expires_ns == (1_100 + 30) * 10**9


def test_a_lease_that_ran_out_is_taken_over_and_its_old_holder_is_fenced(db):
    [batch_id] = add_running_batches(db, 1)
    [old] = leases.claim(db=db, holder="a", seconds=-1)  # run out already
    [new] = leases.claim(db=db, holder="b", seconds=30)
    assert (old.token, new.token) == (1, 2)
    assert leases.renew(db=db, leases=[old, new], seconds=30) == {batch_id}
    with pytest.raises(LeaseLost):
        batches.save_checkpoint(
            db=db, batch_id=batch_id, progress=Progress(completed=1), output_bytes=9, error_bytes=0, lease=old
        )
    with pytest.raises(LeaseLost):
        batches.transition(db=db, batch_id=batch_id, to=BatchStatus.CANCELLING, lease=old)
    batches.save_checkpoint(
        db=db, batch_id=batch_id, progress=Progress(completed=2), output_bytes=7, error_bytes=0, lease=new
    )
    row = batches.get(db=db, batch_id=batch_id, owner=None)
    assert (row.status, row.completed, row.output_bytes_done, row.parts_token) == (BatchStatus.IN_PROGRESS, 2, 7, 2)
    leases.release(db=db, lease=new)
    [again] = leases.claim(db=db, holder="c", seconds=30)  # released: taken at once
    assert again.token == 3


def test_leases_of_this_hosts_dead_processes_are_freed(db):
    ids = add_running_batches(db, 3)
    gone = psutil.Popen(["true"])
    gone.wait()
    me = psutil.Process()
    holders = [
        f"{socket.gethostname()}/{gone.pid}/{int(time.time())}/x",  # exited
        f"{socket.gethostname()}/{os.getpid()}/{int(me.create_time())}/y",  # this process: alive
        f"another-host/{gone.pid}/1/z",  # not ours to judge
    ]
    for batch_id, holder in zip(ids, holders, strict=True):
        with session_scope(db) as session:
            row = session.get(BatchRow, batch_id)
            row.lease_holder, row.lease_expires_ns, row.lease_token = holder, time.time_ns() + 10**12, 1
            session.add(row)
            session.commit()
    assert leases.release_dead(db=db) == 1
    assert [lease.batch_id for lease in leases.claim(db=db, holder="h", seconds=30)] == [ids[0]]


def lease_ended(db, batch_id: str) -> bool:
    return batches.get(db=db, batch_id=batch_id, owner=None).lease_expires_ns is None


def test_a_stalled_service_loses_its_batch_to_another_and_writes_nothing_after(settings):
    settings = settings.model_copy(update={"lease_seconds": 2.0})
    other_engine = FakeEngine()
    with held_batch(settings, lines=20, answered=5) as held:
        client, stalled_engine, batch = held.client, held.engine, held.batch
        stalled: EngineService = client.app.state.engine
        # Stop the stalled service's loop dead, as SIGSTOP would: no renewals, no writes.
        frozen, thawed = threading.Event(), threading.Event()

        def freeze() -> None:
            frozen.set()
            thawed.wait()

        assert stalled._loop is not None
        stalled._loop.call_soon_threadsafe(freeze)
        assert frozen.wait(10)
        other = EngineService(other_engine)
        db = make_engine(settings.database)
        asyncio.run(other.start(db=db, storage=storage_of(settings), settings=settings))
        try:
            done = wait_status(client, batch["id"], {"completed"}, timeout=30)
            output = read_jsonl(client, done["output_file_id"])
            assert Counter(line["custom_id"] for line in output) == Counter(f"r{i}" for i in range(20))
            assert other_engine.executor.calls == 15  # the five checkpointed lines were not run again
            published = client.get(f"/v1/files/{done['output_file_id']}/content").content
            # Its run over: nothing renews the row's lease now. The service writes the end to the row, then forgets
            # the lease; both are waited for, so the row read below is the ended one whatever the order.
            wait_for(lambda: batch["id"] not in other.leases and lease_ended(db, batch["id"]))
            row = batches.get(db=db, batch_id=batch["id"], owner=None).model_dump()
            # The stalled service comes back, its held lines answered: it finds its lease gone and writes nothing.
            stalled_engine.executor.gate.set()
            thawed.set()
            # Its run is over once the service has dropped the lease and the run its live numbers (its last words).
            wait_for(lambda: batch["id"] not in stalled.leases and stalled.live_stats(batch["id"]) is None)
            assert client.get(f"/v1/batches/{batch['id']}").json() == done
            assert batches.get(db=db, batch_id=batch["id"], owner=None).model_dump() == row
            assert not [name for name in stored_names(settings) if name.startswith(batch["id"])]  # both runs' parts
            assert client.get(f"/v1/files/{done['output_file_id']}/content").content == published
        finally:
            thawed.set()
            asyncio.run(other.stop())
            db.dispose()
