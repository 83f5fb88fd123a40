"""Cursor pagination the way OpenAI's SDK walks it: `after=<last id>` until `has_more` is false."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import tuple_
from sqlmodel import Session, select

from app.core.auth import visible
from app.domain.errors import InvalidRequest
from app.domain.models import DeletedObject

Row = TypeVar("Row", bound=Any)


def page(
    session: Session,
    table: type[Row],
    *,
    owner: str,
    filters: list,
    limit: int,
    after: str | None,
    descending: bool,
) -> tuple[list[Row], bool]:
    """The owner's rows in (created_ns, id) order, strictly after the row `after`, at most `limit`; plus has_more.

    A cursor names the last object of the previous page, which the client may have deleted since (cleanup scripts
    delete as they iterate): its tombstone still says where it stood."""
    statement = select(table).where(table.owner == owner, *filters)
    if after is not None:
        anchor = session.get(table, after) or session.get(DeletedObject, after)
        if anchor is None or not visible(anchor.owner, owner):
            raise InvalidRequest(f"No such object for 'after': {after}", param="after")
        # A row comparison, not its spelled-out OR: the server reads it as a range of the (owner, created_ns, id)
        # index, in order, where the OR made it gather the key's rows and sort them.
        place, anchored = tuple_(table.created_ns, table.id), tuple_(anchor.created_ns, anchor.id)
        statement = statement.where(place < anchored if descending else place > anchored)
    if descending:
        statement = statement.order_by(table.created_ns.desc(), table.id.desc())
    else:
        statement = statement.order_by(table.created_ns.asc(), table.id.asc())
    rows = list(session.exec(statement.limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit
