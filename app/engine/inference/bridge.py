"""The bridge to the engine thread: the thread with its own event loop that everything touching the engine runs on,
and the few things other threads may do to it (wake its loop, ask it to stop, wait for it to end).

Starting a vLLM engine blocks its caller for as long as the model takes to load (a minute or more on a GPU), at
the first start and at every restart after a death; on the API's loop that would leave /health and every route
unanswered for that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any


class EngineThread:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        # The engine thread's loop while it runs, and the events other threads set on it.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.woken: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        # Who waits for the engine thread to end: (their loop, their future), resolved from that thread.
        self._ended = False
        self._end_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._end_lock = threading.Lock()

    def start(self, lifetime: Coroutine[Any, Any, None]) -> None:
        """Run `lifetime` on a new engine thread; it calls `opened` first and `closed` last."""
        self._stop_requested.clear()
        self._ended = False
        self.thread = threading.Thread(target=self._run, args=(lifetime,), name="vbatch-engine", daemon=True)
        self.thread.start()

    def opened(self) -> None:
        """On the engine loop, as its lifetime begins."""
        self.woken, self._stopping = asyncio.Event(), asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def closed(self) -> None:
        self.loop = None

    def wake(self) -> None:
        """From any thread."""
        self._signal(self.woken)

    def request_stop(self) -> None:
        """From any thread."""
        self._stop_requested.set()
        self._signal(self._stopping)

    async def stop_requested(self) -> None:
        """On the engine loop: returns once a stop is asked (one asked before the loop existed is seen here)."""
        assert self._stopping is not None
        if not self._stop_requested.is_set():
            await self._stopping.wait()

    def _signal(self, event: asyncio.Event | None) -> None:
        loop = self.loop
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the engine loop has already closed
                loop.call_soon_threadsafe(event.set)

    async def ended(self) -> None:
        """Waits for the engine thread without blocking a thread of the caller's executor in `join`: one left
        blocked there past the drain deadline would keep the process from ever exiting (asyncio.run waits for it)."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        with self._end_lock:
            if self.thread is None or self._ended:
                return
            self._end_waiters.append((loop, ended))
        await ended

    def _run(self, lifetime: Coroutine[Any, Any, None]) -> None:
        try:
            asyncio.run(lifetime)
        finally:
            with self._end_lock:
                self._ended = True
                waiters, self._end_waiters = self._end_waiters, []
            for loop, ended in waiters:
                with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits any more
                    loop.call_soon_threadsafe(_resolve, ended)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a waiter that gave up (the drain deadline) has cancelled it
        future.set_result(None)
