"""Named points where a fault-injection test makes vbatch die or wait, to prove recovery from that moment.

`VBATCH_FAILPOINT=<name>[,<name>...]` (tests only) turns points on; unset, a point costs one environment lookup.
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

Item = TypeVar("Item")


def _points() -> list[str]:
    return os.environ.get("VBATCH_FAILPOINT", "").split(",")


def armed(name: str) -> bool:
    return name in _points()


def crash_here(name: str) -> None:
    if not armed(name):
        return
    log.warning("failpoint %s: killing the service", name)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def is_poison(body: dict) -> bool:
    return armed(POISON) and body.get("user") == POISON_USER


def _hold_after() -> int | None:
    for point in _points():
        name, _, count = point.partition(":")
        if name == HOLD_AFTER:
            return int(count)
    return None


async def held(items: AsyncIterator[Item], data_dir: Path) -> AsyncIterator[Item]:
    """`items` as they come, unless `hold_after` is armed: then past its count, each waits out the hold file."""
    limit = _hold_after()
    hold_file = data_dir / HOLD_FILE
    sent = 0
    async for item in items:
        if limit is not None and sent >= limit:
            while hold_file.exists():
                await asyncio.sleep(0.05)
        sent += 1
        yield item
