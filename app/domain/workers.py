"""The services that run batches, as each last said: its engine's state, the models it serves, its engine's
configuration, where it answers online requests and how many it has in flight. Each says so every second (`beat`);
an API replica (`vbatch api`, which has no engine) answers /v1/models, /health and the console's engine page from
those that spoke lately (`seen`), and forwards online requests to them (`app.engine.online.forward`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core import clock
from app.core.db import session_scope, write_scope
from app.domain import adapters
from app.domain.adapters import Adapter
from app.domain.models import WorkerRow


@dataclass(frozen=True)
class WorkerState:
    holder: str
    started_at: int
    state: str
    served_models: list[str]
    engine_config: dict
    scheduler_error: str | None
    engine_deaths: int
    url: str | None = None  # its base URL, `http://host:port` (None: not to be forwarded to)
    online_in_flight: int = 0
    adapters: list[Adapter] = field(default_factory=list)  # each also in `served_models`
    url_proof: str | None = None  # `url` proven with the fleet's secret (`app.core.fleet.FleetKey.worker_proof`)


def beat(*, db: Engine, worker: WorkerState) -> None:
    """One statement each second once the row is there (an update; the first beat inserts it)."""
    said: dict[str, Any] = {
        "beat_ns": clock.now_ns(),
        "state": worker.state,
        "served_models_json": json.dumps(worker.served_models),
        "adapters_json": adapters.to_json(worker.adapters),
        "engine_config_json": json.dumps(worker.engine_config, default=str),
        "scheduler_error": worker.scheduler_error,
        "engine_deaths": worker.engine_deaths,
        "url": worker.url,
        "online_in_flight": worker.online_in_flight,
        "url_proof": worker.url_proof,
    }
    with write_scope(db) as session:
        updated = session.exec(update(WorkerRow).where(col(WorkerRow.holder) == worker.holder).values(**said))  # type: ignore[call-overload]
        if updated.rowcount == 0:
            session.add(WorkerRow(holder=worker.holder, started_at=worker.started_at, **said))
        session.commit()


def seen(*, db: Engine, within_seconds: float) -> list[WorkerState]:
    """The services heard from in the last `within_seconds`, the longest running first."""
    since = clock.now_ns() - int(within_seconds * 1e9)
    with session_scope(db) as session:
        statement = select(WorkerRow).where(col(WorkerRow.beat_ns) >= since).order_by(col(WorkerRow.started_at))
        return [_state(row) for row in session.exec(statement).all()]


def forget(*, db: Engine, holder: str) -> None:
    """A service that stops says so: it is gone from /health at once, not when it falls silent."""
    with write_scope(db) as session:
        session.exec(delete(WorkerRow).where(col(WorkerRow.holder) == holder))  # type: ignore[call-overload]
        session.commit()


def _state(row: WorkerRow) -> WorkerState:
    return WorkerState(
        holder=row.holder,
        started_at=row.started_at,
        state=row.state,
        served_models=json.loads(row.served_models_json),
        engine_config=json.loads(row.engine_config_json),
        scheduler_error=row.scheduler_error,
        engine_deaths=row.engine_deaths,
        url=row.url,
        online_in_flight=row.online_in_flight,
        adapters=adapters.from_json(row.adapters_json),
        url_proof=row.url_proof,
    )
