"""Time in the units OpenAI's objects use."""

from __future__ import annotations

import time


def now() -> int:
    """Unix seconds, as every `*_at` field carries."""
    return int(time.time())


def now_ns() -> int:
    return time.time_ns()


def monotonic() -> float:
    """Seconds on a clock that never goes back, for intervals; what a test drives in place of the real one."""
    return time.monotonic()
