"""The engine service, the facade the API and the console use (`app.engine.online.view`): one vLLM engine per
process, and the batches it runs.

It is made of parts a reader can name, in the engine's rooms (`app/engine/__init__.py`): the bridge to the engine
thread (`inference/bridge.py`: everything that touches the engine runs on a thread of its own, with its own event
loop), the scheduling loop (`scheduling/scheduler.py`), the lease holder (`scheduling/holder.py`), the watchdog
(`scheduling/watchdog.py`), and the one registry of the batches it holds that those three share (`batch/runs.py`).
This module starts and stops the engine and wires them. The API thread only reads plain attributes
(`state`, `served_models`) and calls `wake` and `stop`, which are safe from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterable
from contextlib import AsyncExitStack
from typing import Literal

from sqlalchemy.engine import Engine

from app.core import clock, logs
from app.core.config import Settings
from app.core.fleet import FleetKey
from app.core.lora_dir import LoraDir, lora_dir
from app.core.storage import Storage
from app.domain import workers
from app.domain.adapters import Adapter, AdapterFinder
from app.domain.estimates import PromptCount
from app.domain.leases import Lease
from app.domain.online import EngineUnavailable, OnlineAnswer, OnlineRequest
from app.domain.schemas import RunStats
from app.domain.workers import WorkerState
from app.engine.batch.context import Context
from app.engine.batch.runs import Runs
from app.engine.inference.bridge import EngineThread
from app.engine.inference.found_adapters import ClaimableAdapters, adapter_finder
from app.engine.inference.serving import (
    EngineDead,
    EngineFactory,
    Serving,
    engine_devices,
    engine_wave,
    max_loras,
    schedules_by_priority,
)
from app.engine.online.requests import OnlineRequests
from app.engine.scheduling.holder import LeaseHolder
from app.engine.scheduling.scheduler import Scheduler
from app.engine.sharing.pacing import PaceNumbers, PrefillPacer
from app.engine.sharing.recovering import RecoveringEngine
from app.engine.sharing.window import InFlightWindow, WindowSize
from app.engine.telemetry.metrics import Metrics
from app.engine.telemetry.steps import EngineSteps, StepSummary

log = logging.getLogger("vbatch.engine")
# The engine's step budget when its config does not say (vLLM's `--max-num-batched-tokens`).
DEFAULT_STEP_TOKENS = 8192


class EngineService:
    """`factory` starts an engine (None: an API that never runs one, as for printing the OpenAPI document)."""

    def __init__(
        self, factory: EngineFactory | None, *, models: list[str] | None = None, adapters: list[Adapter] | None = None
    ) -> None:
        """`models`: the names the engine will serve (`--served-model-name`, else `--model`), and `adapters` (its
        `--lora-modules`), answered by /v1/models from the start, before the engine has loaded; the engine's own
        lists replace them once it serves."""
        self.factory = factory
        self.model_name: str | None = models[0] if models else None
        self.engine = RecoveringEngine(self._start_engine, self._stop_engine)
        self.adapters: list[Adapter] = list(adapters or [])
        self.served_models: list[str] = list(models or []) + [adapter.name for adapter in self.adapters]
        self._found: dict[str, Adapter] = {}  # adapters of `VBATCH_LORA_DIR` batches have run on (`announce`)
        self._lora_dir: LoraDir | None = None  # `VBATCH_LORA_DIR` (`start`)
        # How the engine that serves now finds adapters by name (None: no VBATCH_LORA_DIR, or no engine yet).
        self.find_adapter: AdapterFinder | None = None
        self.engine_config: dict[str, object] = {}
        self.started_at = clock.now()
        self.url: str | None = None  # where `vbatch api` forwards online requests to (`advertise`)
        self._fleet: FleetKey | None = None  # proves `url` to the replicas (`start`; None: nobody forwards here)
        self.metrics = Metrics()
        self.steps = EngineSteps()  # every step of every engine this service starts
        self._stack = AsyncExitStack()
        self._bridge = EngineThread()
        self._ctx: Context | None = None
        self.runs = Runs()
        self._holder = LeaseHolder(
            self.runs,
            serves=lambda: self.served_models,
            adapters=ClaimableAdapters(lambda: self.find_adapter),
        )
        # The batch window (`Context.window`, once there is one) hears of online traffic.
        self._online = OnlineRequests(
            engine=self.engine, bridge=self._bridge, window=lambda: getattr(self._ctx, "window", None)
        )
        self._scheduler = Scheduler(
            engine=self.engine, runs=self.runs, holder=self._holder, bridge=self._bridge, worker_state=self.worker_state
        )

    @property
    def state(self) -> Literal["starting", "ok", "restarting", "down"]:
        return self.engine.state

    @property
    def deaths(self) -> int:
        return self.engine.deaths

    @property
    def holder(self) -> str:
        """This service's name as a lease holder (`app.domain.leases.holder_name`)."""
        return self._holder.name

    @property
    def leases(self) -> dict[str, Lease]:
        """The batches this service holds, by id (a snapshot, from any thread)."""
        return self.runs.leases_by_id()

    @property
    def scheduler_error(self) -> str | None:
        """Why the loop could not look for work at its last try (None: it could); /health reports it."""
        return self._scheduler.error

    @property
    def _thread(self) -> threading.Thread | None:
        return self._bridge.thread

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._bridge.loop

    def metrics_text(self) -> bytes:
        return self.engine.metrics_text()

    def worker_state(self) -> WorkerState:
        return WorkerState(
            holder=self.holder,
            started_at=self.started_at,
            state=self.state,
            served_models=list(self.served_models),
            adapters=list(self.adapters),
            engine_config=dict(self.engine_config),
            scheduler_error=self.scheduler_error,
            engine_deaths=self.engine.deaths,
            url=self.url,
            online_in_flight=self._online.in_flight,
            url_proof=self._fleet.worker_proof(self.holder, self.url) if self._fleet and self.url else None,
        )

    def announce(self, found: Iterable[Adapter]) -> None:
        """Adapters of `VBATCH_LORA_DIR` a batch runs on (the engine loads each at its first line): listed with the
        served models from now on, in /v1/models and in this worker's beats, across engine restarts (the engine
        loads them again at their next use). From any thread: the lists are replaced, never changed in place."""
        self._found.update((adapter.name, adapter) for adapter in found)
        self._list_models(self.served_models, self.adapters)

    def _list_models(self, served: list[str], adapters: list[Adapter]) -> None:
        """`served` and `adapters` as the engine lists them, then the found adapters it does not list (yet)."""
        found = [adapter for name, adapter in self._found.items() if name not in served]
        self.adapters = [*adapters, *found]
        self.served_models = [*served, *(adapter.name for adapter in found)]

    def advertise(self, url: str) -> None:
        """Where this service answers online requests forwarded by `vbatch api`, when that is known only once its
        server is bound (a Ray replica's free port); else `start` takes it from the settings."""
        self.url = url

    def live_stats(self, batch_id: str) -> RunStats | None:
        """A running batch's live numbers, from any thread; None when it is not running here."""
        return self.runs.stats(batch_id)

    def live_rates(self) -> dict[str, tuple[float, float]]:
        """Each running batch's (requests/s, output tokens/s), from any thread."""
        return self.runs.rates()

    def waiting_for_turn(self) -> int:
        """Batches queued for their turn to feed the engine, from any thread (a snapshot)."""
        ctx = self._ctx
        return ctx.feed.waiting() if ctx is not None else 0

    @property
    def batch_window(self) -> WindowSize | None:
        """The batch's in-flight window now and at most (`app.engine.sharing.window`), from any thread; None before the
        engine first serves."""
        ctx = self._ctx
        return ctx.window.numbers if ctx is not None else None

    def engine_steps(self) -> tuple[StepSummary | None, PaceNumbers | None]:
        """The engine's recent steps (None: none in the last seconds) and the batch's pacing (None before the engine
        first serves), from any thread: what the console's engine page shows."""
        pacer = self._ctx.window.pacer if self._ctx is not None else None
        return self.steps.summary(), pacer.numbers() if pacer is not None else None

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled); from any thread."""
        self._bridge.wake()

    async def respond(self, request: OnlineRequest) -> OnlineAnswer:
        """On the caller's loop (`app.engine.online.requests`); raises EngineUnavailable unless the engine is ok."""
        answer = await self._online.respond(request)
        if answer.status < 400:
            await self._announce_found(request.body.get("model"))
        return answer

    async def _announce_found(self, model: object) -> None:
        """An adapter of `VBATCH_LORA_DIR` an online request ran on is listed from now on, as one a batch ran on
        (`vllm serve` lists what its resolver loaded). The finder reads the disk or an object store: off the loop,
        once an adapter, since it is served after."""
        finder = self.find_adapter
        if finder is None or not isinstance(model, str) or model in self.served_models:
            return
        try:
            found = await asyncio.to_thread(finder, model)
        except Exception as exc:  # the answer stands; the adapter is listed once a later look-up succeeds
            log.warning("could not look up %r in VBATCH_LORA_DIR: %s", model, exc)
            return
        if isinstance(found, Adapter):
            self.announce([found])

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None] | None:
        """On the caller's loop: each body's prompt tokens, counted from the engine thread's loop, which hands the
        work off itself (`Serving.count_tokens`). Raises EngineUnavailable unless the engine is ok."""
        loop = self._bridge.loop
        if loop is None or self.state != "ok":
            raise EngineUnavailable(self.state)
        counting = asyncio.run_coroutine_threadsafe(self.engine.count_tokens(endpoint, bodies), loop)
        try:
            return await asyncio.wrap_future(counting)
        except EngineDead:
            raise EngineUnavailable(self.engine.state) from None

    async def start(
        self,
        *,
        db: Engine,
        storage: Storage,
        settings: Settings,
        metrics: Metrics | None = None,
        hold_at_most: int | None = None,
    ) -> None:
        """Returns at once: the engine starts, and batches run, on the engine thread. It holds at most `hold_at_most`
        batches at once (None: every active batch, as `vbatch serve` alone does)."""
        self._holder.hold_at_most = hold_at_most
        self._lora_dir = lora_dir(settings)
        self.url = self.url or settings.advertised_url
        self._online.shared_cache = settings.shared_prefix_cache
        self._fleet = settings.fleet_key()
        self.metrics = metrics or Metrics()
        self.engine.engine_time.price = settings.gpu_hour_price
        self.metrics.count_engine_time(self.engine.engine_time)
        self._bridge.start(self._lifetime(db, storage, settings))

    def request_stop(self) -> None:
        """Abort what runs (finished work is checkpointed) and stop the engine; from any thread."""
        self._bridge.request_stop()

    async def stop(self) -> None:
        """`request_stop`, then wait for the engine thread."""
        self.request_stop()
        await self._bridge.ended()

    async def _lifetime(self, db: Engine, storage: Storage, settings: Settings) -> None:
        self._bridge.opened()
        self._online.opened()
        main = asyncio.create_task(self._main(db, storage, settings))
        beat = asyncio.create_task(self._scheduler.beat(db))
        listen = asyncio.create_task(self._scheduler.listen(db))
        await self._bridge.stop_requested()
        self._online.close()
        running = self.runs.tasks()
        for task in [*running, main, beat, listen]:
            task.cancel()
        await asyncio.gather(*running, main, beat, listen, return_exceptions=True)
        await self._holder.release_all(db)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(workers.forget, db=db, holder=self.holder)
        await self._stop_engine()
        self._bridge.closed()

    async def _main(self, db: Engine, storage: Storage, settings: Settings) -> None:
        # On a thread while the engine starts, which it does at once (the state /health reports); done before any
        # claim.
        freeing = asyncio.ensure_future(self._holder.release_dead(db))
        try:
            serving = await self.engine.start()
        except Exception:
            log.exception("the engine failed to start")
            self.engine.state = "down"
        else:
            self._scheduler.say_now()  # API replicas list its models within the second
            await freeing
            await self._scheduler.schedule(self._context(serving, db, storage, settings))
        await freeing
        await self._scheduler.without_engine(db, storage, settings)

    def _context(self, serving: Serving, db: Engine, storage: Storage, settings: Settings) -> Context:
        # Enough to keep every engine slot busy plus a queue to refill from, without holding the whole file.
        wave = engine_wave(serving)
        self.engine.engine_time.devices = engine_devices(serving)
        max_in_flight = settings.max_in_flight or 2 * wave
        target = settings.live_ttft_target_ms / 1000
        step_tokens = serving.engine_config.get("max_num_batched_tokens")
        pacer = PrefillPacer(
            steps=self.steps,
            ttft_target_seconds=target,
            max_step_tokens=step_tokens if isinstance(step_tokens, int) else DEFAULT_STEP_TOKENS,
            budget_tokens=settings.live_prefill_tokens,
        )
        window = InFlightWindow(max_size=max_in_flight, wave=wave, ttft_target_seconds=target, pacer=pacer)
        self.metrics.watch_window(lambda: window.numbers, self.engine.preemptions, lambda: window.withdrawn)
        self.metrics.watch_steps(self.steps, pacer.numbers)
        ctx = Context(
            db=db,
            storage=storage,
            settings=settings,
            engine=self.engine,
            served_models=self.served_models,
            adapters=self.adapters,
            max_in_flight=max_in_flight,
            wave=wave,
            ranks=max(1, serving.data_parallel_size),
            window=window,
            metrics=self.metrics,
            runs=self.runs,
            shard_lines=0 if self._holder.hold_at_most is None else settings.shard_lines,
            batch_priority=schedules_by_priority(serving),
            find_adapter=self.find_adapter,
            announce=self.announce,
            max_loras=max_loras(serving),
        )
        self._ctx = ctx
        logs.ensure_enabled()
        log.info("engine ready: serving %s, up to %d requests in flight", self.served_models, max_in_flight)
        return ctx

    async def _start_engine(self) -> Serving:
        assert self.factory is not None, "an engine service needs an engine factory to start an engine"
        self._stack = AsyncExitStack()
        serving = await self._stack.enter_async_context(self.factory())
        serving.on_step(self.steps.record)
        self._list_models(serving.served_models, serving.adapters)
        self.engine_config = dict(serving.engine_config)
        self.model_name = self.served_models[0]
        # Before the engine is called ok: an online request may name an adapter of the folder at once.
        self.find_adapter = adapter_finder(self._lora_dir, base=self.model_name, engine_config=serving.engine_config)
        return serving

    async def _stop_engine(self) -> None:
        with contextlib.suppress(Exception):  # a dead engine may fail to shut down cleanly; it is gone either way
            await self._stack.aclose()
