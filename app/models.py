"""SQLModel tables: what vbatch stores about files and batches."""

from __future__ import annotations

from sqlmodel import Field, SQLModel


class FileRow(SQLModel, table=True):
    __tablename__ = "files"

    id: str = Field(primary_key=True)
    # Nanosecond creation time: a total order for listing and cursors (several files share a second).
    created_ns: int = Field(index=True)
    created_at: int
    expires_at: int | None = None
    bytes: int
    filename: str
    purpose: str = Field(index=True)
    status: str = "processed"
    batch_id: str | None = Field(default=None, index=True)
    # The API key (its owner id, app.auth) that uploaded it, or whose batch wrote it.
    owner: str = Field(default="", index=True)


class BatchRow(SQLModel, table=True):
    __tablename__ = "batches"

    id: str = Field(primary_key=True)
    created_ns: int = Field(index=True)
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str = Field(index=True)
    owner: str = Field(default="", index=True)
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

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    # The last checkpoint: how many bytes of `<id>.output.part` / `<id>.error.part` are fsynced and counted above.
    # A restart cuts the part files back to these lengths, so counts and files always agree.
    output_bytes_done: int = 0
    error_bytes_done: int = 0
