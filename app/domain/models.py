"""SQLModel tables: what vbatch stores about files and batches."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Index, text
from sqlmodel import AutoString, Field, SQLModel

from app.domain.lifecycle import ACTIVE, BatchStatus

# The rows of active batches, as the partial indexes that serve claims say it: a query that says it in the same words
# (literals, not parameters) is one the server can serve from them, also as a prepared statement.
ACTIVE_ROWS = text("status IN ({})".format(", ".join(f"'{status.value}'" for status in sorted(ACTIVE))))


class FileRow(SQLModel, table=True):
    __tablename__ = "files"
    # A key's files newest first, a page at a time (`app.domain.pagination`).
    __table_args__ = (Index("ix_files_owner_created", "owner", "created_ns", "id"),)

    id: str = Field(primary_key=True)
    # Nanosecond creation time: a total order for listing and cursors (several files share a second).
    created_ns: int = Field(index=True, sa_type=BigInteger)
    created_at: int
    expires_at: int | None = None
    bytes: int = Field(sa_type=BigInteger)
    filename: str
    purpose: str = Field(index=True)
    status: str = "processed"
    batch_id: str | None = Field(default=None, index=True)
    # The API key (its owner id, app.core.auth) that uploaded it, or whose batch wrote it (`ix_files_owner_created`).
    owner: str = ""
    # The model a batch input's first line names (read from the head the upload already sniffs): a batch made
    # from it has its `model` from its creation, and only a worker that serves that model claims it.
    model: str | None = None


class BatchRow(SQLModel, table=True):
    __tablename__ = "batches"
    __table_args__ = (
        # A key's batches newest first, a page at a time (`app.domain.pagination`).
        Index("ix_batches_owner_created", "owner", "created_ns", "id"),
        # Claims: the active batches in the order of their turns (`app.domain.leases.claim`).
        Index("ix_batches_claim_order", "turn", "created_ns", postgresql_where=ACTIVE_ROWS, sqlite_where=ACTIVE_ROWS),
        # A new batch's turn: its key's last active one (`app.domain.turns`).
        Index("ix_batches_owner_turn", "owner", "turn", postgresql_where=ACTIVE_ROWS, sqlite_where=ACTIVE_ROWS),
    )

    id: str = Field(primary_key=True)
    created_ns: int = Field(index=True, sa_type=BigInteger)
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus = Field(sa_type=AutoString, index=True)
    owner: str = ""  # looked up by `ix_batches_owner_created`
    # From the input file's first line at creation (`FileRow.model`), which decides the workers that may claim the
    # batch; validation sets the model every line runs on (the base model of a mix of it and its adapters).
    model: str | None = None
    errors_json: str | None = None
    metadata_json: str | None = None
    output_expires_after_seconds: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None

    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    total: int = 0
    completed: int = 0
    failed: int = 0

    input_tokens: int = Field(default=0, sa_type=BigInteger)
    cached_tokens: int = Field(default=0, sa_type=BigInteger)
    output_tokens: int = Field(default=0, sa_type=BigInteger)
    reasoning_tokens: int = Field(default=0, sa_type=BigInteger)
    # How its answers ended (`Progress`): those cut at their cap, their output tokens, and the extremes estimates
    # compare a file's caps with.
    cut_lines: int = 0
    cut_output_tokens: int = Field(default=0, sa_type=BigInteger)
    shortest_cut_output: int = 0
    longest_uncut_output: int = 0
    # The engine time its requests used (`app.domain.cost`), as of the last checkpoint: kept with the counts, so a
    # resumed run goes on from it.
    gpu_seconds: float = 0.0

    # The last checkpoint: how many bytes of the output and error part files are fsynced and counted above.
    # A restart cuts the part files back to these lengths, so counts and files always agree.
    output_bytes_done: int = Field(default=0, sa_type=BigInteger)
    error_bytes_done: int = Field(default=0, sa_type=BigInteger)
    # Whose part files the checkpoint above counts: the lease token of the run that wrote them
    # (`app.domain.results.part_names`; 0 for batches from before leases).
    parts_token: int = 0
    # Its place in the order claims take waiting batches: round robin over keys (`app.domain.turns`).
    turn: int = Field(default=0, sa_type=BigInteger)
    # Which service runs the batch (`app.domain.leases`): its holder, until when, and the fencing token every write
    # of that run must carry. A claim bumps the token, so a holder that lost its lease can no longer write.
    lease_holder: str | None = None
    lease_expires_ns: int | None = Field(default=None, sa_type=BigInteger)
    lease_token: int = 0
    # A large batch that workers share is cut into shards (`app.engine.batch.shards`): hidden batches of its lines, each
    # with `parent_id` and its place (`shard`) in the parent's planned order; the parent counts its `shards`.
    parent_id: str | None = Field(default=None, index=True)
    shard: int | None = None
    shards: int = 0
    # The run's live numbers (`RunStats` without its series, JSON) as of its last checkpoint: what an API replica,
    # which has no run of its own to ask, shows while the batch runs on a worker. Cleared when the batch ends.
    live_json: str | None = None
    # Seconds from the start of the last run to each stage it reached (JSON), written when the batch ends.
    timeline_json: str | None = None
    # The rate history of that run (`RunStats.series`, JSON), written when the batch ends.
    series_json: str | None = None

    def stamp(self, status: BatchStatus, at: int) -> None:
        """The time the batch first reached `status` (a status reached again keeps its first time)."""
        match status:
            case BatchStatus.IN_PROGRESS:
                self.in_progress_at = self.in_progress_at or at
            case BatchStatus.FINALIZING:
                self.finalizing_at = self.finalizing_at or at
            case BatchStatus.COMPLETED:
                self.completed_at = self.completed_at or at
            case BatchStatus.FAILED:
                self.failed_at = self.failed_at or at
            case BatchStatus.EXPIRED:
                self.expired_at = self.expired_at or at
            case BatchStatus.CANCELLING:
                self.cancelling_at = self.cancelling_at or at
            case BatchStatus.CANCELLED:
                self.cancelled_at = self.cancelled_at or at


class DeletedObject(SQLModel, table=True):
    """What a deleted object leaves behind: enough for a list cursor that names it to page on from where it stood
    (clients delete while they iterate), and no more."""

    __tablename__ = "deleted_objects"

    id: str = Field(primary_key=True)
    created_ns: int = Field(sa_column=Column(BigInteger, nullable=False))
    owner: str = Field(default="", index=True)


class WebhookEvent(SQLModel, table=True):
    """An outbox row: written in the transaction that ends its batch, sent (at least once) by `app.outbox`."""

    __tablename__ = "webhook_events"

    id: str = Field(primary_key=True)  # evt_...: also the webhook-id header, so receivers can drop repeats
    type: str
    batch_id: str = Field(index=True)
    owner: str = ""
    created_at: int
    attempts: int = 0
    # When it may be tried next (unix seconds); claiming an event moves it on by a lease, so one sender has it.
    next_attempt_at: float = Field(index=True)
    delivered_at: int | None = None
    given_up_at: int | None = None
    last_error: str | None = None


class WorkerRow(SQLModel, table=True):
    """A service that runs batches (`vbatch serve` or `vbatch worker`), as it last said: API replicas read the
    models served and the engines' state from here."""

    __tablename__ = "workers"

    holder: str = Field(primary_key=True)  # its name on the batch leases it holds (`app.domain.leases`)
    started_at: int
    beat_ns: int = Field(sa_type=BigInteger, index=True)
    state: str
    served_models_json: str = "[]"
    adapters_json: str = "[]"  # the LoRA adapters among `served_models_json`, with their base models
    engine_config_json: str = "{}"
    scheduler_error: str | None = None
    engine_deaths: int = 0
    # Where it answers online requests (`VBATCH_ADVERTISE_URL`), and how many it has in flight: what an API replica
    # forwards them by (`app.engine.online.forward`). None: it cannot be forwarded to (a service of an older version).
    url: str | None = None
    online_in_flight: int = 0
    # Its URL's proof under the fleet's secret (`app.core.fleet`): a replica forwards to no worker whose proof fails.
    url_proof: str | None = None


class EndedConsoleSession(SQLModel, table=True):
    """A console session logged out before its cookie expired (`app.console.sessions.end`): refused by every
    process that shares the database until `expires_at`, when the cookie would be refused anyway."""

    __tablename__ = "ended_console_sessions"

    nonce: str = Field(primary_key=True)
    expires_at: int = Field(index=True)
