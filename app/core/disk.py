"""Room on the data directory's file system, and what vbatch does when there is none.

SQLite needs a few pages free to commit anything, the end of a batch and a cancel included, and a full disk is
usually filled by something else (a log, another job) faster than vbatch could notice. So vbatch keeps a reserve:
a file of real blocks that it deletes the moment the disk fills, which gives the database room to record what
happened (a batch that ends, a cancel, a delete that frees space); it is written again once the disk has room.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
from pathlib import Path

log = logging.getLogger("vbatch.disk")

SQLITE_FULL = 13
_CHUNK = b"\0" * (1 << 20)


class DiskFull(Exception):
    """The data directory has no room (or less than vbatch keeps free) for what was asked."""


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or a quota from a write, or SQLite's SQLITE_FULL (which SQLAlchemy wraps), or our own DiskFull."""
    if isinstance(exc, DiskFull):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    orig = getattr(exc, "orig", None)
    return isinstance(orig, sqlite3.Error) and getattr(orig, "sqlite_errorcode", None) == SQLITE_FULL


class DiskReserve:
    """`size` bytes held in `path` while at least `keep_free` bytes are free besides; 0 keeps no reserve."""

    def __init__(self, path: Path, *, size: int, keep_free: int) -> None:
        self.path = path
        self.size = size
        self.keep_free = keep_free

    @property
    def held(self) -> bool:
        return self.size == 0 or self.path.exists()

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path.parent).free

    def release(self) -> None:
        if self.size and self.path.exists():
            self.path.unlink(missing_ok=True)
            log.error("the disk of %s is full: released the %d-byte reserve", self.path.parent, self.size)

    def keep(self) -> None:
        """Release the reserve when the disk is nearly full; write it again once there is room for it and more."""
        if self.size == 0:
            return
        free = self.free_bytes()
        if self.path.exists():
            if free < self.keep_free:
                self.release()
        elif free >= self.size + self.keep_free:
            self._write()

    def _write(self) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            with partial.open("wb") as out:
                for offset in range(0, self.size, len(_CHUNK)):
                    out.write(_CHUNK[: min(len(_CHUNK), self.size - offset)])
                out.flush()
                os.fsync(out.fileno())
            partial.replace(self.path)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            if not is_disk_full(exc):
                raise
            return
        log.info("holding a %d-byte disk reserve in %s", self.size, self.path)
