"""Webhook events as OpenAI sends them: one for every batch that reaches a final state.

The event row is written in the transaction that ends the batch (`batches.end_with_files` and the other final moves), so
a batch never ends without its event nor an event exist for a batch that has not ended; `app.outbox` sends it.
"""

from __future__ import annotations

import json

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core.db import write_scope
from app.core.ids import new_id
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow, WebhookEvent

EVENT_TYPES = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.CANCELLED: "batch.cancelled",
    BatchStatus.EXPIRED: "batch.expired",
}


def for_batch(row: BatchRow, *, now: int) -> WebhookEvent:
    return WebhookEvent(
        id=new_id("evt_"),
        type=EVENT_TYPES[row.status],
        batch_id=row.id,
        owner=row.owner,
        created_at=now,
        next_attempt_at=now,
    )


def payload(event: WebhookEvent) -> str:
    """The body, exactly what is signed."""
    body = {
        "id": event.id,
        "object": "event",
        "type": event.type,
        "created_at": event.created_at,
        "data": {"id": event.batch_id},
    }
    return json.dumps(body, separators=(",", ":"))


def claim_due(*, db: Engine, now: float, lease: float, limit: int) -> list[WebhookEvent]:
    """Events to send now, each moved `lease` seconds on first, so that no other sender takes it meanwhile."""
    with write_scope(db) as session:
        statement = (
            select(WebhookEvent)
            .where(col(WebhookEvent.delivered_at).is_(None), col(WebhookEvent.given_up_at).is_(None))
            .where(WebhookEvent.next_attempt_at <= now)
            .order_by(col(WebhookEvent.next_attempt_at))
            .limit(limit)
            .with_for_update(skip_locked=True)  # Postgres: senders in other processes take other events
        )
        rows = list(session.exec(statement).all())
        for row in rows:
            row.next_attempt_at = now + lease
            session.add(row)
        session.commit()
    return rows


def record_attempt(
    *, db: Engine, event_id: str, now: int, delivered: bool, error: str | None, retry_at: float | None
) -> None:
    """After a try: delivered, or to be tried again at `retry_at`, or (None) given up."""
    with write_scope(db) as session:
        row = session.get(WebhookEvent, event_id, with_for_update=True)
        if row is None:
            return
        row.attempts += 1
        row.last_error = error
        if delivered:
            row.delivered_at = now
        elif retry_at is None:
            row.given_up_at = now
        else:
            row.next_attempt_at = retry_at
        session.add(row)
        session.commit()
