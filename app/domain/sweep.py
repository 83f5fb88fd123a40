"""At start, before any work: remove what a crash left in the files directory that nothing refers to.

Torn uploads (temporary files, or bytes whose row was never committed), result files linked by a batch that
crashed before it committed them, the part files, input links and indexes of batches that ended. Nothing else
is touched.
"""

from __future__ import annotations

import logging

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core.db import session_scope
from app.core.storage import Storage
from app.domain.lifecycle import ACTIVE
from app.domain.models import BatchRow, FileRow
from app.domain.results import is_run_file

log = logging.getLogger("vbatch.sweep")


def sweep_storage(*, db: Engine, storage: Storage) -> int:
    with session_scope(db) as session:
        keep = set(session.exec(select(FileRow.id)).all())
        active = session.exec(select(BatchRow.id).where(col(BatchRow.status).in_(ACTIVE))).all()
    removed = 0
    for name in storage.names():
        if name not in keep and not any(is_run_file(name, batch_id) for batch_id in active):
            storage.remove_any(name)
            removed += 1
    if removed:
        log.info("removed %d files left by an earlier crash", removed)
    return removed
