"""What the API and the console see of the engine: `EngineService` in a process that runs batches (`vbatch
serve`, `vbatch worker`), `WorkersView` in an API replica (`vbatch api`), which has no engine, reads what the
workers last said (`app.domain.workers`) and forwards online requests to them (`app.engine.online.forward`)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Literal, Protocol

from sqlalchemy.engine import Engine

from app.core import clock
from app.core.config import Settings
from app.core.fleet import FleetSecretMissing, Networks
from app.core.storage import Storage
from app.domain import batches, workers
from app.domain.adapters import Adapter
from app.domain.errors import NotFound
from app.domain.estimates import PromptCount
from app.domain.online import EngineUnavailable, OnlineAnswer, OnlineRequest
from app.domain.schemas import RunStats
from app.domain.workers import WorkerState
from app.engine.online.forward import UNREACHABLE, Forwarder
from app.engine.sharing.pacing import PaceNumbers
from app.engine.sharing.window import WindowSize
from app.engine.telemetry.metrics import Metrics
from app.engine.telemetry.steps import StepSummary

State = Literal["starting", "ok", "restarting", "down"]
# How long a worker may be silent and still count (it says so every second).
SEEN_SECONDS = 10.0


class EngineView(Protocol):
    started_at: int

    @property
    def state(self) -> State: ...
    @property
    def served_models(self) -> list[str]:
        """The base models first, then the LoRA adapters (`adapters`)."""
        ...

    @property
    def adapters(self) -> list[Adapter]: ...
    @property
    def model_name(self) -> str | None: ...
    @property
    def engine_config(self) -> dict[str, object]: ...
    @property
    def scheduler_error(self) -> str | None: ...
    @property
    def deaths(self) -> int: ...
    @property
    def batch_window(self) -> WindowSize | None:
        """The batch's in-flight window now and at most (`app.engine.sharing.window`); None without an engine here."""
        ...

    def engine_steps(self) -> tuple[StepSummary | None, PaceNumbers | None]:
        """The engine's recent steps (`app.engine.telemetry.steps`) and the batch's pacing
        (`app.engine.sharing.pacing`); (None, None) without an engine here."""
        ...

    def metrics_text(self) -> bytes: ...
    def live_stats(self, batch_id: str) -> RunStats | None: ...
    def live_rates(self) -> dict[str, tuple[float, float]]: ...
    def wake(self) -> None: ...
    async def respond(self, request: OnlineRequest) -> OnlineAnswer:
        """An online request's answer (`app.domain.online`), on the caller's event loop; raises EngineUnavailable
        when no engine can answer it now."""
        ...

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None] | None:
        """Each body's prompt tokens on the served model's tokenizer (None for one it cannot count); None when no
        engine here counts (an API replica). Raises EngineUnavailable when the engine is not up."""
        ...

    async def start(
        self,
        *,
        db: Engine,
        storage: Storage,
        settings: Settings,
        metrics: Metrics | None = None,
        hold_at_most: int | None = None,
    ) -> None: ...
    async def stop(self) -> None: ...


class WorkersView:
    """The engines of the workers that spoke in the last `SEEN_SECONDS`, read at most once a second; a running
    batch's live numbers as its worker kept them at its last checkpoint; online requests forwarded to them."""

    def __init__(self) -> None:
        self.started_at = clock.now()
        self._db: Engine | None = None
        self._lock = threading.Lock()
        self._read_at = 0.0
        self._finds_adapters = False  # whether `VBATCH_LORA_DIR` is set (`start`)
        self._seen: list[WorkerState] = []
        self._ever_seen = False  # whether any worker has spoken since this replica started
        self._forwarder: Forwarder | None = None

    async def start(
        self,
        *,
        db: Engine,
        storage: Storage,
        settings: Settings,
        metrics: Metrics | None = None,
        hold_at_most: int | None = None,
    ) -> None:
        self._db = db
        fleet = settings.fleet_key()
        if fleet is None:
            raise FleetSecretMissing("an API replica forwards online requests only with VBATCH_FLEET_SECRET set")
        self._forwarder = Forwarder(
            silence_seconds=settings.forward_silence_seconds,
            fleet=fleet,
            networks=Networks(settings.fleet_networks),
            ca_file=settings.fleet_ca_file,
        )
        self._finds_adapters = settings.lora_dir is not None

    async def stop(self) -> None:
        self._db = None
        forwarder, self._forwarder = self._forwarder, None
        if forwarder is not None:
            await forwarder.aclose()

    def workers(self) -> list[WorkerState]:
        with self._lock:
            if self._stale():
                assert self._db is not None
                self._seen = workers.seen(db=self._db, within_seconds=SEEN_SECONDS)
                self._read_at = time.monotonic()
                self._ever_seen = self._ever_seen or bool(self._seen)
            return self._seen

    def _stale(self) -> bool:
        return self._db is not None and time.monotonic() - self._read_at >= 1.0

    @property
    def state(self) -> State:
        return _state_of(self.workers(), self._ever_seen)

    @property
    def served_models(self) -> list[str]:
        return list(dict.fromkeys(model for worker in self.workers() for model in worker.served_models))

    @property
    def adapters(self) -> list[Adapter]:
        by_name = {adapter.name: adapter for worker in self.workers() for adapter in worker.adapters}
        return list(by_name.values())

    @property
    def model_name(self) -> str | None:
        models = self.served_models
        return models[0] if models else None

    @property
    def engine_config(self) -> dict[str, object]:
        seen = self.workers()
        return dict(seen[0].engine_config) if seen else {}

    @property
    def scheduler_error(self) -> str | None:
        return next((worker.scheduler_error for worker in self.workers() if worker.scheduler_error), None)

    @property
    def deaths(self) -> int:
        return sum(worker.engine_deaths for worker in self.workers())

    @property
    def batch_window(self) -> WindowSize | None:
        return None  # each worker's is on its own /metrics (vbatch_batch_window)

    def engine_steps(self) -> tuple[StepSummary | None, PaceNumbers | None]:
        return None, None  # each worker's are on its own /metrics (vbatch_engine_step_*) and console

    def metrics_text(self) -> bytes:
        return b""  # each worker's engine series are on its own /metrics

    def live_stats(self, batch_id: str) -> RunStats | None:
        """What the worker running it kept at its last checkpoint (a read; an API replica has no run to ask); None
        while no live worker holds it (its worker died: those numbers are not now's)."""
        if self._db is None:
            return None
        try:
            row = batches.get(db=self._db, batch_id=batch_id, owner=None)
        except NotFound:
            return None
        if row.lease_holder not in {worker.holder for worker in self.workers()}:
            return None
        return batches.stored_live(row)

    def live_rates(self) -> dict[str, tuple[float, float]]:
        return {}

    async def respond(self, request: OnlineRequest) -> OnlineAnswer:
        """Forwarded to the least busy worker that serves the body's model (`app.engine.online.forward`)."""
        if self._forwarder is None:
            raise EngineUnavailable("starting")
        # The database is read on a thread (at most once a second): never on the loop, which serves every request.
        seen = await asyncio.to_thread(self.workers) if self._stale() else self._seen
        able = self._forwarder.candidates(seen, request.body.get("model"))
        if not able and self._finds_adapters:
            # An adapter of VBATCH_LORA_DIR no worker has loaded yet (the API found its folder): any worker loads it.
            able = self._forwarder.candidates(seen, None)
        if not able:
            state = _state_of(seen, self._ever_seen)
            raise EngineUnavailable(UNREACHABLE if state == "ok" else state)
        return await self._forwarder.forward(able, request)

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None] | None:
        """Unknown: an API replica has no tokenizer, and a worker's front ends are its batches' (an estimate here
        gives what needs no count, and says its token counts are unknown)."""
        return None

    def wake(self) -> None:
        """Workers hear of new work from the database (`db.announce_work`), or find it at their next poll."""


def _state_of(seen: list[WorkerState], ever_seen: bool) -> State:
    """`ok` while any worker's engine is; else the most hopeful state among them; with none, `starting` until a
    worker has spoken, `down` once the workers there were have gone."""
    states = {worker.state for worker in seen}
    for state in ("ok", "restarting", "starting"):
        if state in states:
            return state  # type: ignore[return-value]
    return "down" if states or ever_seen else "starting"
