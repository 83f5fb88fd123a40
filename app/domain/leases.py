"""Which service runs which batch: a lease per batch, with a fencing token.

A service that runs batches claims the active ones it will run. A claim takes a batch nobody holds, or whose
holder let its lease run out, and bumps the batch's token. The holder renews its leases while it holds them; every
write its run makes (a status move, a checkpoint, the published result files) is accepted only with the current
token (`LeaseLost` otherwise), so a holder that stalled past its lease and came back writes nothing over the run
that took the batch over. Part files carry the token in their names for the same reason
(`app.domain.results.part_names`).

One path on both databases, hand-written rather than a job library's: the claim is a batch's own row (its status
is the work's state), and procrastinate, the library that fits best, runs on Postgres only while SQLite stays the
default. On Postgres a claim skips rows another claim has locked (SKIP LOCKED); SQLite takes its write lock for
the whole claim (BEGIN IMMEDIATE).

Claims take batches in the order of their turns (`app.domain.turns`): round robin over keys, each key's own batches
oldest first. A holder renews all its leases in one statement (`renew`).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import psutil
from sqlalchemy import ColumnElement, or_, true, tuple_, update
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core import clock
from app.core.db import session_scope, write_scope
from app.domain.lifecycle import BatchStatus
from app.domain.models import ACTIVE_ROWS, BatchRow


@dataclass(frozen=True)
class Lease:
    batch_id: str
    holder: str
    token: int


class LeaseLost(Exception):
    """The batch's lease has passed to another holder (or was released): this run may no longer write."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(f"batch {batch_id}: its lease has passed on")
        self.batch_id = batch_id


def claim(
    *, db: Engine, holder: str, seconds: float, limit: int | None = None, models: Collection[str] | None = None
) -> list[Lease]:
    """Leases on active batches no one holds (by turn: round robin over keys; at most `limit`), each with a new
    token. With `models`
    (a worker beside others), only batches for one of them or for no model in particular, and those any worker
    can end: being cancelled, or past their completion window (`app.engine.batch.ending.Unserved`). A batch for a
    model no worker serves waits for one until then, and no longer."""
    now = clock.now_ns()
    with write_scope(db) as session:
        statement = (
            select(BatchRow)
            .where(ACTIVE_ROWS)
            .where(or_(col(BatchRow.lease_holder).is_(None), col(BatchRow.lease_expires_ns) < now))
            .where(_for_models(models))
            .order_by(col(BatchRow.turn).asc(), col(BatchRow.created_ns).asc())
            .with_for_update(skip_locked=True)
            .limit(limit)
        )
        rows = session.exec(statement).all()
        # From the moment the rows are locked, not from before the wait for a connection and the lock: a claimer
        # paused in between (a pool's wait, SIGSTOP) came back holding leases already run out (the fleet bench: 4).
        expires = clock.now_ns() + int(seconds * 1e9)
        leases = []
        for row in rows:
            row.lease_holder = holder
            row.lease_token += 1
            row.lease_expires_ns = expires
            session.add(row)
            leases.append(Lease(row.id, holder, row.lease_token))
        session.commit()
    return leases


def unheld_models(*, db: Engine, limit: int = 100) -> list[str]:
    """The models named by active batches no one holds: those a worker may look up among the adapters it could
    load (`app.engine.scheduling.holder`)."""
    now = clock.now_ns()
    with session_scope(db) as session:
        statement = (
            select(col(BatchRow.model))
            .where(ACTIVE_ROWS, col(BatchRow.model).is_not(None))
            .where(or_(col(BatchRow.lease_holder).is_(None), col(BatchRow.lease_expires_ns) < now))
            .distinct()
            .limit(limit)
        )
        return [model for model in session.exec(statement).all() if model is not None]


def _for_models(models: Collection[str] | None) -> ColumnElement[bool]:
    if models is None:
        return true()
    model = col(BatchRow.model)
    endable = or_(col(BatchRow.status) == BatchStatus.CANCELLING, col(BatchRow.expires_at) <= clock.now())
    return or_(model.is_(None), model.in_(list(models)), endable)


def renew(*, db: Engine, leases: Iterable[Lease], seconds: float) -> set[str]:
    """Extend each lease that is still its holder's, all in one statement; returns the ids of those that are not."""
    held = list(leases)
    if not held:
        return set()
    expires = clock.now_ns() + int(seconds * 1e9)
    with write_scope(db) as session:
        statement = (
            update(BatchRow)
            .where(tuple_(col(BatchRow.id), col(BatchRow.lease_token)).in_([(h.batch_id, h.token) for h in held]))
            .where(col(BatchRow.lease_holder).in_({h.holder for h in held}))
            .values(lease_expires_ns=expires)
            .returning(col(BatchRow.id), col(BatchRow.lease_holder))
        )
        kept = {(batch_id, holder) for batch_id, holder in session.exec(statement).all()}  # type: ignore[call-overload]
        session.commit()
    return {lease.batch_id for lease in held if (lease.batch_id, lease.holder) not in kept}


def release(*, db: Engine, lease: Lease) -> None:
    """Give the batch up now (a service stopping): the next claim takes it without waiting for the lease to end."""
    with write_scope(db) as session:
        statement = (
            update(BatchRow)
            .where(col(BatchRow.id) == lease.batch_id, col(BatchRow.lease_token) == lease.token)
            .values(lease_holder=None, lease_expires_ns=None)
        )
        session.exec(statement)  # type: ignore[call-overload]
        session.commit()


def end(*, db: Engine, lease: Lease) -> None:
    """The batch has ended under `lease`: nothing renews it from now on, and the row keeps who ran it last."""
    with write_scope(db) as session:
        statement = (
            update(BatchRow)
            .where(col(BatchRow.id) == lease.batch_id, col(BatchRow.lease_token) == lease.token)
            .values(lease_expires_ns=None)
        )
        session.exec(statement)  # type: ignore[call-overload]
        session.commit()


def holder_name() -> str:
    """A name for one service in one process: its host, its process (pid and start time, so that a reused pid is
    another process), and a tag (two services in one process are two holders)."""
    process = psutil.Process()
    return f"{socket.gethostname()}/{process.pid}/{int(process.create_time())}/{uuid.uuid4().hex[:8]}"


def release_dead(*, db: Engine) -> int:
    """Free the leases whose holder ran on this host in a process that no longer exists: a service restarted after a
    crash takes its batches back at once rather than when their leases run out."""
    host = socket.gethostname()
    with write_scope(db) as session:
        holders = session.exec(select(BatchRow.lease_holder).where(col(BatchRow.lease_holder).is_not(None)).distinct())
        dead = [holder for holder in holders.all() if holder is not None and _dead_here(holder, host)]
        if dead:
            session.exec(  # type: ignore[call-overload]
                update(BatchRow)
                .where(col(BatchRow.lease_holder).in_(dead))
                .values(lease_holder=None, lease_expires_ns=None)
            )
        session.commit()
    return len(dead)


def _dead_here(holder: str, host: str) -> bool:
    parts = holder.split("/")
    if len(parts) != 4 or parts[0] != host or not parts[1].isdigit():
        return False
    try:
        return int(psutil.Process(int(parts[1])).create_time()) != int(parts[2])
    except psutil.NoSuchProcess:
        return True


def check(row: BatchRow, lease: Lease | None) -> None:
    """For a write under `lease` (None: a write that needs none, such as a cancel request from the API)."""
    if lease is not None and (row.lease_token != lease.token or row.lease_holder != lease.holder):
        raise LeaseLost(row.id)
