"""Named points where a fault-injection test makes vbatch die, wait or raise, to prove recovery from that moment.

`VBATCH_FAILPOINT=<name>[,<name>...]` (tests only) arms points for the life of the process: the environment is
read once, at import. Unarmed, a point is a lookup in an empty set, and the wrappers below are not installed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("vbatch.failpoints")

# The whole service dies here, as a `kill -9` of its process group would do.
UPLOAD_SAVED = "upload_saved"  # an upload's bytes are on disk, its row is not
RESULTS_LINKED = "results_linked"  # a finishing batch's result files are linked, the batch row not yet final
# Every request whose body carries this `user` kills the engine core process (and only it) before it runs.
POISON = "poison"
POISON_USER = "vbatch-poison"
# `hold_after:N`: each feed of a batch sends N lines, then sends no more while `<data dir>/failpoint-hold` exists.
# A test that must act on a batch mid-run (kill, cancel, SIGTERM) holds it there, however fast the engine is.
HOLD_AFTER = "hold_after"
HOLD_FILE = "failpoint-hold"
# These raise `FailpointError` where an ending can fail on what a batch holds, to prove every batch still ends.
UNFINISHED_LINES_RAISE = "unfinished_lines_raise"  # writing the error lines of requests that never ran
PUBLISH_RAISES = "publish_raises"  # publishing a finished batch's result files

Item = TypeVar("Item")


class FailpointError(RuntimeError):
    pass


class Failpoints:
    def __init__(self, spec: str) -> None:
        self.points = frozenset(point for point in spec.split(",") if point)
        self.hold_after: int | None = None
        for point in self.points:
            name, _, count = point.partition(":")
            if name == HOLD_AFTER:
                self.hold_after = int(count)

    def armed(self, name: str) -> bool:
        return name in self.points

    def raise_here(self, name: str) -> None:
        if name in self.points:
            raise FailpointError(f"failpoint {name}")

    def crash_here(self, name: str) -> None:
        if name not in self.points:
            return
        log.warning("failpoint %s: killing the service", name)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def held(self, items: AsyncIterator[Item], data_dir: Path) -> AsyncIterator[Item]:
        """`items` themselves, unless `hold_after` is armed: then past its count, each waits out the hold file."""
        if self.hold_after is None:
            return items
        return _held(items, data_dir / HOLD_FILE, self.hold_after)


async def _held(items: AsyncIterator[Item], hold_file: Path, limit: int) -> AsyncIterator[Item]:
    sent = 0
    async for item in items:
        if sent >= limit:
            while hold_file.exists():
                await asyncio.sleep(0.05)
        sent += 1
        yield item


ARMED = Failpoints(os.environ.get("VBATCH_FAILPOINT", ""))
