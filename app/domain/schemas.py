"""OpenAI wire objects, exactly as the Files and Batch APIs return them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.domain.lifecycle import BatchStatus


class OpenAIFile(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIFile]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedFile(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None


class RunStats(BaseModel):
    """A running batch's live numbers (a vbatch extension)."""

    requests_per_second: float | None
    output_tokens_per_second: float | None
    # Null until the rate can say how long the rest will take.
    eta_seconds: float | None
    # Seconds from the start of the batch's (last) run to each stage reached: planned, all_sent, first_result,
    # last_result, published.
    timeline: dict[str, float]
    # [seconds into the run, requests/s, output tokens/s] for each step of about a second or more.
    series: list[list[float]] = []


class BatchProgress(BaseModel):
    """`GET /v1/batches/{id}/progress`: what `GET /v1/batches/{id}` says, plus how fast (a vbatch extension)."""

    object: Literal["batch.progress"] = "batch.progress"
    id: str
    status: BatchStatus
    request_counts: RequestCounts
    # Live while the batch runs; once it has ended, `timeline` is its last run's and the rates are null.
    requests_per_second: float | None
    output_tokens_per_second: float | None
    eta_seconds: float | None
    timeline: dict[str, float] | None
    # [seconds into the run, requests/s, output tokens/s] for each step of about a second or more, the whole run at
    # a step that grows with it; once the batch has ended, its last run's.
    series: list[list[float]] = []
    # Why a batch no worker holds is not running yet (null otherwise): "waiting for a worker that serves 'm'".
    waiting: str | None = None
    # What the batch used and cost (`app.domain.cost`); only here, never on the batch object or its webhooks.
    gpu_seconds: float | None = Field(
        default=None,
        description="Engine time the batch's requests used, as of its last checkpoint: the seconds the engine had "
        "requests in flight times its GPUs (tensor x data parallel size), shared with other batches and online "
        "requests by the tokens each finished (uncached prompt + output). On a CPU build these are engine-seconds. "
        "Null before the batch runs.",
    )
    gpu_hour_price: float | None = Field(
        default=None, description="USD per GPU-hour the cost is reckoned at (VBATCH_GPU_HOUR_PRICE); null: unpriced."
    )
    cost_usd: float | None = Field(default=None, description="gpu_seconds / 3600 x gpu_hour_price, in USD.")
    cost_per_million_input_tokens: float | None = Field(
        default=None,
        description="cost_usd per million of the batch's input tokens (the whole cost over them: with the output "
        "figure, two views of one cost, not to be added). Null without a price or input tokens.",
    )
    cost_per_million_output_tokens: float | None = Field(
        default=None,
        description="cost_usd per million of the batch's output tokens (the whole cost over them). Null without a "
        "price or output tokens.",
    )


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


class Model(BaseModel):
    """OpenAI's Model object. A LoRA adapter's also has `parent` and `root`, as `vllm serve` lists adapters; a base
    model's has neither (the routes leave out fields that are None)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = Field(default=None, description="A LoRA adapter's base model (vLLM's extension).")
    root: str | None = Field(default=None, description="Where the engine loaded a LoRA adapter from (vLLM's).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthStatus(BaseModel):
    # starting/restarting/down: the engine; unavailable: the engine is up, but the database, the disk or the
    # engine loop is not (`problems` says which).
    status: Literal["ok", "starting", "restarting", "down", "unavailable"]
    model: str | None
    problems: list[str] = []
