"""What every batch's run shares: the database, the storage, the engine, the scheduling state, and the registry of
the batches this service holds (`runs.py`). What is one batch's alone is its `Run` (`run.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from app.core.config import Settings
from app.core.storage import Storage
from app.domain.adapters import Adapter, AdapterFinder
from app.engine.batch.runs import Runs
from app.engine.sharing.feed import Changes, FairFeed
from app.engine.sharing.recovering import RecoveringEngine
from app.engine.sharing.window import InFlightWindow
from app.engine.telemetry.metrics import Metrics


@dataclass
class Context:
    db: Engine
    storage: Storage
    settings: Settings
    engine: RecoveringEngine  # the serving engine as runs see it: one executor that survives its deaths
    served_models: list[str]  # the base models, then the adapters (`adapters`)
    adapters: list[Adapter]
    max_in_flight: int
    # Requests the engine runs at once (max_num_seqs on every data-parallel rank): a wave, for the ETA.
    wave: int
    # Data-parallel ranks: each shared-prefix group is pinned to one (`app.engine.batch.ordering.pin_to_ranks`).
    ranks: int
    # Batch lines in flight at once, fewer while online requests need room (`app.engine.sharing.window`).
    window: InFlightWindow
    metrics: Metrics
    # LoRA adapters the engine runs at once (`--max-loras`; None: it serves none): a batch's lines of more adapters
    # are fed a few adapters at a time (`app.engine.batch.ordering.AdapterGate`).
    max_loras: int | None = None
    # The engine schedules by priority (`--scheduling-policy priority`, vbatch's default): batch lines then run
    # behind online requests (`app.domain.online.batch_line_body`); under `fcfs` they keep the priority they have.
    batch_priority: bool = True
    # A batch of more lines than this is cut into shards other workers may claim (0: never; `app.engine.batch.shards`).
    shard_lines: int = 0
    # Whose batch submits its lines now (round robin over keys); batches overlap only at the tail.
    feed: FairFeed = field(default_factory=FairFeed)
    # Told when a batch is created or cancelled: what batches waiting for their turn wake on.
    changes: Changes = field(default_factory=Changes)
    # The batches this service holds (`app.engine.batch.runs`): a run shows its live numbers there.
    runs: Runs = field(default_factory=Runs)
    # Adapters found by name in `VBATCH_LORA_DIR` (None: unset), and where a batch that runs on some tells of them:
    # the service lists them with its served models from then on (`EngineService.announce`).
    find_adapter: AdapterFinder | None = None
    announce: Callable[[Iterable[Adapter]], None] = lambda adapters: None
