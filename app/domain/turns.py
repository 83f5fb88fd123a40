"""Whose batch the fleet claims next: round robin over keys.

Each batch is given a turn when it is created, and workers claim waiting batches in the order of their turns, then
of their creation (`app.domain.leases.claim`). A key's batch comes one turn after that key's last active batch, and
no earlier than the turn claims have reached: the lowest turn still waiting (or, with none waiting, the highest
active one). So a key with a hundred batches waiting has one claimed a turn, and a key that comes late waits behind
no other key's backlog, only behind the batches of the turn claims are at; a batch whose worker died keeps its
turn, and is claimed again first. Every batch counts as one, whatever its lines (start-time fair queuing with a
unit cost). Within a worker the feed's round robin (`app.engine.sharing.feed`) shares its engine between the batches it
holds.
"""

from __future__ import annotations

from sqlmodel import Session, col, func, select

from app.domain.models import ACTIVE_ROWS, BatchRow


def next_turn(session: Session, owner: str) -> int:
    """The turn of a batch `owner` creates now; read in the transaction that creates it, which holds the key's lock
    (two batches of one key get two turns)."""
    own_last = select(func.max(BatchRow.turn)).where(
        ACTIVE_ROWS, col(BatchRow.owner) == owner, col(BatchRow.parent_id).is_(None)
    )
    lowest_waiting = select(func.min(BatchRow.turn)).where(ACTIVE_ROWS, col(BatchRow.lease_holder).is_(None))
    highest_active = select(func.max(BatchRow.turn)).where(ACTIVE_ROWS)
    own, waiting, highest = session.exec(
        select(own_last.scalar_subquery(), lowest_waiting.scalar_subquery(), highest_active.scalar_subquery())
    ).one()
    reached = waiting if waiting is not None else (highest or 0)
    return reached if own is None else max(reached, own + 1)
