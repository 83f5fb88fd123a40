"""The engine service: one live vLLM engine per process, and the loop that feeds it batches in creation order.

Everything that touches the engine runs on a thread of its own, with its own event loop. Starting a vLLM engine
blocks its caller for as long as the model takes to load (a minute or more on a GPU), at the first start and at
every restart after a death; on the API's loop that would leave /health and every route unanswered for that long.
The API thread only reads plain attributes (`state`, `served_models`) and calls `wake` and `stop`, which are safe
from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Any, Literal

from sqlalchemy.engine import Engine

from app.core import clock, logs
from app.core.config import Settings
from app.core.db import work_announcements
from app.core.storage import Storage
from app.domain import batches, leases, workers
from app.domain.leases import Lease, LeaseLost
from app.domain.models import BatchRow
from app.domain.schemas import RunStats
from app.domain.workers import WorkerState
from app.engine.context import Context
from app.engine.ending import end_overdue
from app.engine.live import LiveEngine
from app.engine.metrics import Metrics
from app.engine.run import Run
from app.engine.runner import run_batch
from app.engine.serving import EngineDead, EngineFactory, Serving, engine_wave

log = logging.getLogger("vbatch.engine")

# How often the loop looks for work even when nobody woke it (batches created by another process, expiry).
POLL_SECONDS = 1.0


class EngineService:
    """`factory` starts an engine (None: an API that never runs one, as for printing the OpenAPI document)."""

    def __init__(self, factory: EngineFactory | None) -> None:
        self.factory = factory
        self.model_name: str | None = None
        self.live = LiveEngine(self._start_engine, self._stop_engine)
        self.served_models: list[str] = []
        self.engine_config: dict[str, object] = {}
        self.started_at = clock.now()
        self._stack = AsyncExitStack()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        # Who waits for the engine thread to end: (their loop, their future), resolved from that thread.
        self._thread_ended = False
        self._end_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._end_lock = threading.Lock()
        self._running: dict[str, asyncio.Task] = {}
        self._ctx: Context | None = None
        self.metrics = Metrics()
        # Why the loop could not look for work at its last try (None: it could); /health reports it.
        self.scheduler_error: str | None = None
        # Batches whose run raised something unexpected: not retried in a loop, picked up again at the next start.
        self._broken: set[str] = set()
        # Overdue batches the watchdog could not end at all (no database write went through): tried again quietly.
        self._unended: set[str] = set()
        # The batches this service holds (`app.domain.leases`), by id; renewed at every look for work.
        self.holder = leases.holder_name()
        self.leases: dict[str, Lease] = {}
        self.hold_at_most: int | None = None

    @property
    def state(self) -> Literal["starting", "ok", "restarting", "down"]:
        return self.live.state

    @property
    def deaths(self) -> int:
        return self.live.deaths

    def metrics_text(self) -> bytes:
        return self.live.metrics_text()

    def worker_state(self) -> WorkerState:
        return WorkerState(
            holder=self.holder,
            started_at=self.started_at,
            state=self.state,
            served_models=list(self.served_models),
            engine_config=dict(self.engine_config),
            scheduler_error=self.scheduler_error,
            engine_deaths=self.live.deaths,
        )

    def live_stats(self, batch_id: str) -> RunStats | None:
        """A running batch's live numbers, from any thread; None when it is not running here."""
        ctx = self._ctx
        run = ctx.runs.get(batch_id) if ctx is not None else None
        return run.stats() if run is not None else None

    def live_rates(self) -> dict[str, tuple[float, float]]:
        """Each running batch's (requests/s, output tokens/s), from any thread."""
        ctx = self._ctx
        rates = {}
        for batch_id, run in list(ctx.runs.items()) if ctx is not None else []:
            stats = run.stats()
            if stats is not None:
                rates[batch_id] = (stats.requests_per_second or 0.0, stats.output_tokens_per_second or 0.0)
        return rates

    def waiting_for_turn(self) -> int:
        """Batches queued for their turn to feed the engine, from any thread (a snapshot)."""
        ctx = self._ctx
        return ctx.feed.waiting() if ctx is not None else 0

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled); from any thread."""
        self._signal(self._wake)

    def _signal(self, event: asyncio.Event | None) -> None:
        loop = self._loop
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the engine loop has already closed
                loop.call_soon_threadsafe(event.set)

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
        self._stop_requested.clear()
        self.hold_at_most = hold_at_most
        self.metrics = metrics or Metrics()
        self._thread_ended = False
        self._thread = threading.Thread(
            target=self._run_thread, args=(self._lifetime(db, storage, settings),), name="vbatch-engine", daemon=True
        )
        self._thread.start()

    def request_stop(self) -> None:
        """Abort what runs (finished work is checkpointed) and stop the engine; from any thread."""
        self._stop_requested.set()
        self._signal(self._stopping)

    async def stop(self) -> None:
        """`request_stop`, then wait for the engine thread."""
        self.request_stop()
        await self._thread_end()

    async def _thread_end(self) -> None:
        """Waits for the engine thread without blocking a thread of the caller's executor in `join`: one left
        blocked there past the drain deadline would keep the process from ever exiting (asyncio.run waits for it)."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        with self._end_lock:
            if self._thread is None or self._thread_ended:
                return
            self._end_waiters.append((loop, ended))
        await ended

    def _run_thread(self, lifetime: Coroutine[Any, Any, None]) -> None:
        try:
            asyncio.run(lifetime)
        finally:
            with self._end_lock:
                self._thread_ended = True
                waiters, self._end_waiters = self._end_waiters, []
            for loop, ended in waiters:
                with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits any more
                    loop.call_soon_threadsafe(_resolve, ended)

    async def _lifetime(self, db: Engine, storage: Storage, settings: Settings) -> None:
        self._wake, self._stopping = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        main = asyncio.create_task(self._main(db, storage, settings))
        beat = asyncio.create_task(self._beat(db))
        listen = asyncio.create_task(self._listen(db))
        if not self._stop_requested.is_set():  # a stop asked before the loop existed is seen here
            await self._stopping.wait()
        for task in [*self._running.values(), main, beat, listen]:
            task.cancel()
        await asyncio.gather(*self._running.values(), main, beat, listen, return_exceptions=True)
        await asyncio.to_thread(self._release_all, db)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(workers.forget, db=db, holder=self.holder)
        await self._stop_engine()
        self._loop = None

    async def _main(self, db: Engine, storage: Storage, settings: Settings) -> None:
        # On a thread while the engine starts, which it does at once (the state /health reports); done before any
        # claim.
        freeing = asyncio.ensure_future(self._release_dead(db))
        try:
            serving = await self.live.start()
        except Exception:
            log.exception("the engine failed to start")
            self.live.state = "down"
        else:
            await freeing
            await self._schedule(self._context(serving, db, storage, settings))
        await freeing
        # No engine: nothing runs, but every batch still ends once its completion window (and the grace) has passed.
        while True:
            try:
                storage.reserve.keep()
                await self._watch(db, storage, settings, await self._hold(db, settings))
            except Exception:
                log.exception("the watchdog could not look at the batches; it tries again in %s s", POLL_SECONDS)
            await asyncio.sleep(POLL_SECONDS)

    async def _release_dead(self, db: Engine) -> None:
        with contextlib.suppress(Exception):  # an unreadable database is reported by the first look for work
            if freed := await asyncio.to_thread(leases.release_dead, db=db):
                log.info("freed the leases of %d holders on this host whose processes are gone", freed)

    def _context(self, serving: Serving, db: Engine, storage: Storage, settings: Settings) -> Context:
        # Enough to keep every engine slot busy plus a queue to refill from, without holding the whole file.
        wave = engine_wave(serving)
        max_in_flight = settings.max_in_flight or 2 * wave
        ctx = Context(
            db=db,
            storage=storage,
            settings=settings,
            engine=self.live,
            served_models=self.served_models,
            max_in_flight=max_in_flight,
            wave=wave,
            ranks=max(1, serving.data_parallel_size),
            slots=asyncio.Semaphore(max_in_flight),
            metrics=self.metrics,
            shard_lines=0 if self.hold_at_most is None else settings.shard_lines,
        )
        self._ctx = ctx
        logs.ensure_enabled()
        log.info("engine ready: serving %s, up to %d requests in flight", self.served_models, max_in_flight)
        return ctx

    async def _start_engine(self) -> Serving:
        assert self.factory is not None, "an engine service needs an engine factory to start an engine"
        self._stack = AsyncExitStack()
        serving = await self._stack.enter_async_context(self.factory())
        self.served_models = serving.served_models
        self.engine_config = dict(serving.engine_config)
        self.model_name = self.served_models[0]
        return serving

    async def _stop_engine(self) -> None:
        with contextlib.suppress(Exception):  # a dead engine may fail to shut down cleanly; it is gone either way
            await self._stack.aclose()

    async def _schedule(self, ctx: Context) -> None:
        """Looks for work until the engine is down. A look that fails (the database unreadable for a moment, or for
        good) is logged and tried again at the next poll, with /health saying so meanwhile; it never ends the loop."""
        assert self._wake is not None
        while self.state in ("ok", "restarting"):
            self._wake.clear()
            try:
                await self._look_for_work(ctx)
                self.scheduler_error = None
            except Exception as exc:
                if self.scheduler_error is None:
                    log.exception("the engine loop could not look for work; it tries again every %s s", POLL_SECONDS)
                self.scheduler_error = f"the engine loop cannot read its batches ({type(exc).__name__})"
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that comes as the event is
            # set (a stop as a batch ends), and this loop would then never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wake.wait()
            if self._wake.is_set():  # a batch was created or cancelled: batches waiting for a turn look again
                ctx.changes.notify()

    async def _look_for_work(self, ctx: Context) -> None:
        if not self._running:
            await self.live.check()
        ctx.storage.reserve.keep()  # first: with the disk full, holding leases (a write) fails
        rows = await self._watch(ctx.db, ctx.storage, ctx.settings, await self._hold(ctx.db, ctx.settings))
        for row in rows:
            if row.id not in self._running and row.id not in self._broken:
                self._running[row.id] = asyncio.create_task(self._run_one(ctx, row.id))

    async def _watch(self, db: Engine, storage: Storage, settings: Settings, rows: list[BatchRow]) -> list[BatchRow]:
        """End every batch still active `watchdog_grace_seconds` after its completion
        window, stopping its run first if one hangs on: a run ends its own batch at expiry, so one still going
        then is stuck. Returns the batches left active."""
        deadline = clock.now() - settings.watchdog_grace_seconds
        # A parent of shards waits on them, and each shard has its own watchdog.
        overdue = [row for row in rows if row.expires_at is not None and row.expires_at < deadline and not row.shards]
        for row in overdue:
            task = self._running.pop(row.id, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._broken.discard(row.id)
            await self._end_overdue(db, storage, settings, row)
        return [row for row in rows if row not in overdue]

    async def _end_overdue(self, db: Engine, storage: Storage, settings: Settings, row: BatchRow) -> None:
        """Whatever its lines hold, the batch ends (`end_overdue`); only a database that takes no write leaves it
        active, to be tried again at every look, logged the first time only."""
        batch_id = row.id
        quiet = batch_id in self._unended
        if not quiet:
            log.error(
                "batch %s: still active %s s after its window; the watchdog ends it",
                batch_id,
                settings.watchdog_grace_seconds,
            )
        run = Run(row=row, lease=self.leases.get(row.id), db=db, storage=storage, settings=settings)
        ended = await end_overdue(run, quiet=quiet)
        if ended:
            self._unended.discard(batch_id)
        elif not quiet:
            log.error("batch %s: the watchdog could not end it; it tries again every %s s", batch_id, POLL_SECONDS)
            self._unended.add(batch_id)

    async def _hold(self, db: Engine, settings: Settings) -> list[BatchRow]:
        """Renew this service's leases, stop the runs of those it lost, and claim the batches no one holds: the
        active batches it now holds, oldest first."""
        # Each database call runs on a thread, and what it returns is applied here: the leases, the runs and their
        # tasks are the loop's alone.
        lost = await asyncio.to_thread(
            leases.renew, db=db, leases=list(self.leases.values()), seconds=settings.lease_seconds
        )
        for batch_id in lost:
            del self.leases[batch_id]
            self._broken.discard(batch_id)
            task = self._running.pop(batch_id, None)
            if task is not None:
                log.error("batch %s: its lease passed to another service; this run stops", batch_id)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        room = None if self.hold_at_most is None else self.hold_at_most - len(self.leases)
        if room is None or room > 0:
            await self._claim(db, settings, room)
        rows = [row for row in await asyncio.to_thread(batches.active, db=db) if row.id in self.leases]
        active = {row.id for row in rows}
        for batch_id in [b for b in self.leases if b not in active and b not in self._running]:
            await asyncio.to_thread(leases.end, db=db, lease=self.leases.pop(batch_id))
        return rows

    async def _claim(self, db: Engine, settings: Settings, room: int | None) -> None:
        """Hold what the claim took even when a stop cancels the wait for it: a lease taken without this service
        knowing would not be released at the stop, and would keep its batch from every other one until it ran out."""
        claiming = asyncio.ensure_future(
            asyncio.to_thread(leases.claim, db=db, holder=self.holder, seconds=settings.lease_seconds, limit=room)
        )
        try:
            claimed = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            self._keep(await claiming)
            raise
        self._keep(claimed)

    def _keep(self, claimed: list[Lease]) -> None:
        for lease in claimed:
            self.leases[lease.batch_id] = lease
            if lease.token > 1:
                log.info(
                    "batch %s: held again (lease token %d); it goes on from its last checkpoint",
                    lease.batch_id,
                    lease.token,
                )

    async def _beat(self, db: Engine) -> None:
        """Say every second what this service is, for API replicas (`app.domain.workers`); a beat that fails (the
        database gone for a moment) is tried again at the next."""
        while True:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(workers.beat, db=db, worker=self.worker_state())
            await asyncio.sleep(POLL_SECONDS)

    async def _listen(self, db: Engine) -> None:
        """Look for work as soon as another process announces some (a batch created through an API replica, shards
        cut by another worker), not at the next poll; on a database that announces nothing, the polls find it."""
        assert self._wake is not None
        failed = False
        while True:
            try:
                async for _ in work_announcements(db):
                    failed = False
                    self._wake.set()
            except Exception:
                if not failed:
                    log.warning("cannot listen for work announcements; looking every %s s meanwhile", POLL_SECONDS)
                failed = True
            else:
                return
            await asyncio.sleep(POLL_SECONDS)

    def _release_all(self, db: Engine) -> None:
        """A service that stops gives its batches up, for the next one to take at once."""
        for lease in list(self.leases.values()):
            try:
                leases.release(db=db, lease=lease)
            except Exception:
                log.warning("batch %s: its lease could not be released; it passes on when it runs out", lease.batch_id)
        self.leases.clear()

    async def _run_one(self, ctx: Context, batch_id: str) -> None:
        try:
            await run_batch(ctx, batch_id, self.leases.get(batch_id))
        except asyncio.CancelledError:
            raise
        except LeaseLost:
            log.warning("batch %s: its lease passed to another service; this run stopped without writing", batch_id)
        except EngineDead:
            # Only when a new engine could not be started. Results are checkpointed; the next start resumes.
            log.error("batch %s: stopped, no engine; /health is 503 until vbatch serve is restarted", batch_id)
        except Exception:
            log.exception("batch %s: the engine loop failed on it; it stays as it is until the next start", batch_id)
            self._broken.add(batch_id)
        finally:
            self._running.pop(batch_id, None)
            self.wake()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a waiter that gave up (the drain deadline) has cancelled it
        future.set_result(None)
