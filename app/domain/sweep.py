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
from app.domain.results import run_file_batch

log = logging.getLogger("vbatch.sweep")


# Beside other processes (API replicas, workers), a file nobody refers to may be one being written now (an upload,
# a result file linked a moment before its batch commits it): only one left untouched this long is a leftover.
ORPHAN_AGE_SECONDS = 600.0


def sweep_storage(*, db: Engine, storage: Storage, min_age_seconds: float = 0.0) -> int:
    with session_scope(db) as session:
        keep = set(session.exec(select(FileRow.id)).all())
        active = set(session.exec(select(BatchRow.id).where(col(BatchRow.status).in_(ACTIVE))).all())
    removed = 0
    for name in storage.names():
        if name in keep or run_file_batch(name) in active:
            continue
        if min_age_seconds <= 0 or storage.age_seconds(name) >= min_age_seconds:
            storage.remove_any(name)
            removed += 1
    if removed:
        log.info("removed %d files left by an earlier crash", removed)
    return removed
