"""The engine as batch runs and online requests see it: one executor that survives the engine's death.

When the engine dies every request in flight fails with `EngineDead`; the first run to notice calls `recover`,
which starts a new engine once, however many runs saw the death. Requests that may have killed it are re-run
`isolated`: with nothing else in flight, so that the next death can be laid on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal

from app.domain.estimates import PromptCount
from app.domain.results import Body
from app.engine.inference.serving import EngineDead, Serving, Stream
from app.engine.sharing.execution import Executor
from app.engine.telemetry.metrics import EngineTime

log = logging.getLogger("vbatch.engine")

State = Literal["starting", "ok", "restarting", "down"]


class RecoveringEngine:
    def __init__(self, start: Callable[[], Awaitable[Serving]], stop: Callable[[], Awaitable[None]]) -> None:
        self._start = start
        self._stop = stop
        self._serving: Serving | None = None
        self.state: State = "starting"
        self.generation = 0  # how many times the engine has been started
        self.deaths = 0
        self._restarting = asyncio.Lock()
        self._isolation = asyncio.Lock()
        self._isolation_wanted = 0
        self._open = asyncio.Event()  # cleared while isolated work is wanted or running
        self._open.set()
        self._shared_in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        # Who used the engine's time: it hears of every request that enters and leaves the engine.
        self.engine_time = EngineTime()

    async def start(self) -> Serving:
        self._serving = await self._start()
        self.generation += 1
        self.state = "ok"
        return self._serving

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        await self._open.wait()
        self._shared_in_flight += 1
        self._drained.clear()
        try:
            return await self._call(endpoint, body, rank)
        finally:
            self._shared_in_flight -= 1
            if self._shared_in_flight == 0:
                self._drained.set()

    async def _call(self, endpoint: str, body: dict, rank: int | None) -> tuple[int, Body]:
        if self._serving is None or self.state != "ok":
            raise EngineDead("the engine is not running")
        self.engine_time.started()
        try:
            return await self._serving.execute(endpoint, body, rank)
        finally:
            self.engine_time.ended()

    async def respond(self, endpoint: str, body: dict) -> tuple[int, Body] | Stream:
        """An online request (`app.domain.online`): beside the batch lines, and never held back by isolated work,
        which exists to find a batch line that kills the engine."""
        serving = self._serving
        if serving is None or self.state != "ok":
            raise EngineDead("the engine is not running")
        return await serving.respond(endpoint, body)

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        """Prompt tokens of each body (`Serving.count_tokens`), beside the batch lines like an online request."""
        serving = self._serving
        if serving is None or self.state != "ok":
            raise EngineDead("the engine is not running")
        return await serving.count_tokens(endpoint, bodies)

    def generated_tokens(self) -> int | None:
        serving = self._serving
        return serving.generated_tokens() if serving is not None and self.state == "ok" else None

    def metrics_text(self) -> bytes:
        serving = self._serving
        return serving.metrics_text() if serving is not None else b""

    def preemptions(self) -> int | None:
        """The running engine's preemptions since it started (a new engine counts from 0 again)."""
        serving = self._serving
        return serving.preemptions() if serving is not None and self.state == "ok" else None

    async def check(self) -> None:
        """Restart an engine that died with nothing in flight: no request would notice, and /health would say ok."""
        if self.state != "ok" or self._serving is None or await self._serving.is_alive():
            return
        with contextlib.suppress(EngineDead):  # down: /health says so, the loop stops
            await self.recover(self.generation)

    @asynccontextmanager
    async def isolated(self) -> AsyncIterator[Executor]:
        """An executor whose requests run with no others in flight (other work waits at `execute`)."""
        self._isolation_wanted += 1
        self._open.clear()
        try:
            async with self._isolation:
                await self._drained.wait()
                yield _Isolated(self)
        finally:
            self._isolation_wanted -= 1
            if self._isolation_wanted == 0:
                self._open.set()

    async def recover(self, generation: int) -> None:
        """Start a new engine after the death of engine `generation`; a no-op if that already happened."""
        async with self._restarting:
            if generation != self.generation or self.state == "down":
                if self.state == "down":
                    raise EngineDead("the engine could not be restarted")
                return
            self.deaths += 1
            self.state = "restarting"
            log.error("the engine died (death %d); starting a new one", self.deaths)
            try:
                await self._stop()
                await self.start()
            except Exception as exc:
                self.state = "down"
                log.exception("the engine could not be restarted; /health stays 503 until vbatch serve restarts")
                raise EngineDead("the engine could not be restarted") from exc
            log.info("engine restarted")


class _Isolated:
    def __init__(self, engine: RecoveringEngine) -> None:
        self._engine = engine

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        return await self._engine._call(endpoint, body, rank)
