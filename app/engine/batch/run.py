"""One batch's run as every step of it sees it, resolved once at its top: the batch's row, the lease it runs
under, the names of the files it uses, and its input index once loaded.

No step below the runner looks a batch, a lease or a file name up again by id: each receives the `Run`. A step that
must see what happened meanwhile (a cancel, the last checkpoint) reads `stored`, the batch as the database has it
now.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from app.core import clock
from app.core.config import Settings
from app.core.storage import Storage
from app.domain import batches
from app.domain.input_index import InputIndex
from app.domain.leases import Lease
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.domain.results import Outcome, index_name, input_name, part_names, run_files
from app.engine.batch.parts import ResultSink

# A batch in one of these with `in_progress_at` set has a run to go on with (or to end).
RUNNING = frozenset({BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING})


@dataclass
class Run:
    # The batch as the run last saw it: read at the top, replaced by the moves the run makes.
    row: BatchRow
    lease: Lease | None
    db: Engine
    storage: Storage
    settings: Settings
    # Loaded (or made, at validation) once; None for a batch that runs no line of its own (a parent of shards).
    index: InputIndex | None = None
    # The token of the part files this run writes: its lease's, so that a run that lost its lease cannot write
    # into its successor's (run without one, the last checkpoint's).
    token: int = field(init=False)
    input_name: str = field(init=False)
    index_name: str = field(init=False)
    parts: tuple[str, str] = field(init=False)  # its own output and error part files
    run_files: tuple[str, ...] = field(init=False)  # everything the batch keeps in Storage while it is active

    def __post_init__(self) -> None:
        batch_id = self.row.id
        self.token = self.lease.token if self.lease is not None else self.row.parts_token
        self.input_name = input_name(batch_id)
        self.index_name = index_name(batch_id)
        self.parts = part_names(batch_id, self.token)
        self.run_files = run_files(batch_id, max(self.row.lease_token, self.token))

    @classmethod
    async def resolve(
        cls, *, db: Engine, storage: Storage, settings: Settings, batch_id: str, lease: Lease | None
    ) -> Run:
        row = await asyncio.to_thread(batches.get, db=db, batch_id=batch_id, owner=None)
        return cls(row=row, lease=lease, db=db, storage=storage, settings=settings)

    @property
    def id(self) -> str:
        return self.row.id

    @property
    def waits_for_shards(self) -> bool:
        """A parent of shards whose run has begun: it waits for its shards and joins their results."""
        return self.row.status in RUNNING and bool(self.row.shards)

    @property
    def runs_own_lines(self) -> bool:
        """A batch whose run has begun on lines of its own (not a parent of shards)."""
        return self.row.status in RUNNING and self.row.in_progress_at is not None and not self.row.shards

    def expired(self) -> bool:
        """Whether the batch's completion window has ended."""
        return self.row.expires_at is not None and clock.now() >= self.row.expires_at

    async def stored(self) -> BatchRow:
        """The batch as the database has it now: a cancel, the last checkpoint, a lease passed on."""
        return await asyncio.to_thread(self.stored_now)

    def stored_now(self) -> BatchRow:
        """`stored`, for a block already handed to a thread."""
        return batches.get(db=self.db, batch_id=self.row.id, owner=None)

    async def stored_index(self) -> InputIndex:
        """The index validation kept beside the batch's results (FileNotFoundError if there is none)."""
        return InputIndex.from_bytes(await self.storage.read_bytes(self.index_name))

    def new_sink(self, observe: Callable[[Outcome], None] | None = None) -> ResultSink:
        output, errors = (self.storage.path(name) for name in self.parts)
        return ResultSink(output, errors, observe=observe)

    async def begin_parts(
        self, sink: ResultSink, position_of: Callable[[], dict[str, int]], checkpoint: BatchRow | None = None
    ) -> None:
        """Start the run's parts from what the last checkpoint (`checkpoint`, or the run's row) counts in the parts it
        was taken in (`Storage.begin_parts`), and open them, cut back to it, their lines counted."""
        row = checkpoint or self.row
        previous = part_names(row.id, row.parts_token)
        own = (sink.output.path, sink.errors.path)
        sink.ship = await self.storage.begin_parts(previous, (row.output_bytes_done, row.error_bytes_done), own)
        await sink.open(output_bytes=row.output_bytes_done, error_bytes=row.error_bytes_done, position_of=position_of)
        # The files hold the counts; the engine time is the checkpoint's alone.
        sink.progress.gpu_seconds = row.gpu_seconds

    async def sink_at_checkpoint(self, checkpoint: BatchRow) -> ResultSink:
        """The run's parts, begun from `checkpoint`'s, cut back to it and open again, their lines counted."""
        sink = self.new_sink()
        index = self.index
        # Without an index no line is filled in, so which position a custom_id had does not matter, only the counts.
        await self.begin_parts(sink, index.position_of if index is not None else lambda: defaultdict(int), checkpoint)
        return sink
