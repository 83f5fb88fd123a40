"""The engine service: one live vLLM engine per process, and the loop that feeds it batches in creation order."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from contextlib import AsyncExitStack
from typing import Literal

from sqlalchemy.engine import Engine

from app import batches, clock, logs
from app.config import Settings
from app.engine.execution import EngineDead
from app.engine.live import LiveEngine
from app.engine.runner import Context, run_batch
from app.storage import Storage

log = logging.getLogger("vbatch.engine")

# How often the loop looks for work even when nobody woke it (batches created by another process, expiry).
POLL_SECONDS = 1.0


class EngineService:
    def __init__(self, engine_args: argparse.Namespace | None, model_name: str | None = None) -> None:
        self.engine_args = engine_args
        self.model_name = model_name
        self.live = LiveEngine(self._start_engine, self._stop_engine)
        self.served_models: list[str] = [model_name] if model_name else []
        self.started_at = clock.now()
        self._wake = asyncio.Event()
        self._stack = AsyncExitStack()
        self._loop_task: asyncio.Task | None = None
        self._running: dict[str, asyncio.Task] = {}
        # Batches whose run raised something unexpected: not retried in a loop, picked up again at the next start.
        self._broken: set[str] = set()

    @property
    def state(self) -> Literal["starting", "ok", "restarting", "down"]:
        return self.live.state

    def wake(self) -> None:
        self._wake.set()

    async def start(self, *, db: Engine, storage: Storage, settings: Settings) -> None:
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._main(db, storage, settings))

    async def stop(self) -> None:
        for task in [*self._running.values(), self._loop_task]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        await self._stop_engine()

    async def _main(self, db: Engine, storage: Storage, settings: Settings) -> None:
        try:
            serving = await self.live.start()
        except Exception:
            log.exception("the engine failed to start")
            self.live.state = "down"
            return
        # Enough to keep every engine slot busy plus a queue to refill from, without holding the whole file.
        max_in_flight = settings.max_in_flight or 2 * serving.max_num_seqs
        ctx = Context(
            db=db,
            storage=storage,
            settings=settings,
            engine=self.live,
            served_models=self.served_models,
            max_in_flight=max_in_flight,
            slots=asyncio.Semaphore(max_in_flight),
        )
        logs.ensure_enabled()
        log.info("engine ready: serving %s, up to %d requests in flight", self.served_models, max_in_flight)
        await self._schedule(ctx)

    async def _start_engine(self):
        from app.engine.vllm_adapter import live_engine

        assert self.engine_args is not None, "an engine service needs engine args to start an engine"

        self._stack = AsyncExitStack()
        serving = await self._stack.enter_async_context(live_engine(self.engine_args))
        self.served_models = serving.served_models
        self.model_name = self.served_models[0]
        return serving

    async def _stop_engine(self) -> None:
        with contextlib.suppress(Exception):  # a dead engine may fail to shut down cleanly; it is gone either way
            await self._stack.aclose()

    async def _schedule(self, ctx: Context) -> None:
        while self.state in ("ok", "restarting"):
            self._wake.clear()
            for row in batches.active(db=ctx.db):
                if row.id not in self._running and row.id not in self._broken:
                    self._running[row.id] = asyncio.create_task(self._run_one(ctx, row.id))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=POLL_SECONDS)

    async def _run_one(self, ctx: Context, batch_id: str) -> None:
        try:
            await run_batch(ctx, batch_id)
        except asyncio.CancelledError:
            raise
        except EngineDead:
            # Only when a new engine could not be started. Results are checkpointed; the next start resumes.
            log.error("batch %s: stopped, no engine; /health is 503 until vbatch serve is restarted", batch_id)
        except Exception:
            log.exception("batch %s: the engine loop failed on it; it stays as it is until the next start", batch_id)
            self._broken.add(batch_id)
        finally:
            self._running.pop(batch_id, None)
            self.wake()
