"""The rule for blocking work: no synchronous database or object-store call runs on a thread that runs an event loop.

Such a call stalls every coroutine of that loop for as long as it takes (every request of the API's loop, every batch
of the engine's), and SQLite may wait its 10 s busy timeout for the write lock. It runs in a plain `def` route
(FastAPI's threadpool) or through `asyncio.to_thread` instead. `VBATCH_GUARD_BLOCKING=true`, which the test suite
sets, makes a call that breaks the rule raise; the blocking calls (a connection taken from the pool, a synchronous
obstore call) say so at their entry.
"""

from __future__ import annotations

import asyncio
import functools

from app.core.config import Settings


class BlockingOnLoop(RuntimeError):
    pass


# Every refusal raised in this process, whoever catches it: a broad `except` must not hide one from the tests (their
# conftest fails a test during which one was raised and not expected).
raised: list[str] = []


@functools.cache
def guard_on() -> bool:
    """Read once a process: the check runs at every connection checkout."""
    return Settings().guard_blocking


def refuse_on_loop(call: str) -> None:
    """Raise BlockingOnLoop for `call` if the guard is on and this thread runs an event loop."""
    if not guard_on():
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raised.append(call)
    raise BlockingOnLoop(
        f"{call} on a thread running an event loop: synchronous database and object-store calls run in a plain "
        "`def` route or through asyncio.to_thread (docs/explanation/architecture.md, 'Blocking work')"
    )
