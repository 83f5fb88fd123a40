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


class NotRetriedLine(BaseModel):
    """A line a retry left out: it failed with an error a second try would repeat (a 4xx other than 429)."""

    custom_id: str
    line: int = Field(description="Its 1-based line number in the retried batch's input file.")
    status_code: int
    reason: str = Field(description="The error's type and message, as its error-file line gives them.")


class RetryBatchRequest(BaseModel):
    """The optional body of `POST /v1/batches/{id}/retry`."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, str] | None = Field(
        default=None, description="Replaces the retried batch's metadata in the new batch (`retry_of` is added)."
    )


class BatchRetry(BaseModel):
    """`POST /v1/batches/{id}/retry` (a vbatch extension): the new batch, and the lines it leaves out."""

    object: Literal["batch.retry"] = "batch.retry"
    batch: Batch
    retried: int = Field(description="Lines in the new batch's input file.")
    not_retried_count: int = Field(description="Lines that failed and were left out; `not_retried` lists the first.")
    not_retried: list[NotRetriedLine]


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


# How well an estimate's history tells its output: `measured`, to the token (its answers ended below the file's
# caps, or were cut at caps no lower); `range`, only between a low and a high (`output_reason` says why); `unknown`,
# no history; `none`, the endpoint generates no output.
OutputKnown = Literal["measured", "range", "unknown", "none"]


class EstimateBasis(BaseModel):
    """Where an estimate's figures came from."""

    # `tokenizer`: the served model's tokenizer, chat template applied; `unknown`: no engine here to count with.
    token_counts: Literal["tokenizer", "unknown"]
    # The earlier completed batches of the same model and endpoint the expected output and the rate come from
    # (newest first; empty: no history, so those figures are null).
    history_batch_ids: list[str]
    # Their lines that succeeded, and of those the ones whose answer stopped at its cap (finish_reason `length`).
    history_lines: int
    history_cut_lines: int
    output: OutputKnown
    # Why the output is a range, in words (null unless `output` is `range`).
    output_reason: str | None
    # `measured`: the engine's own rate over those batches' runs; `unknown`: no history.
    rate: Literal["measured", "unknown"]
    # Output tokens per second over those runs (input tokens per second for an endpoint that generates none).
    tokens_per_second: float | None
    rate_unit: Literal["output_tokens", "input_tokens"] | None
    # GPUs the engine holds (tensor x data parallel): the factor from run seconds to GPU-seconds.
    gpus: int


class BatchEstimate(BaseModel):
    """`POST /v1/batches/estimate` (a vbatch extension): what a batch of this body would be, before it exists."""

    object: Literal["batch.estimate"] = "batch.estimate"
    input_file_id: str
    endpoint: str
    model: str | None
    # What the batch's validation would say of the file, with line numbers; null when it is valid (then the
    # figures below are filled in as far as they are known).
    errors: BatchErrors | None
    lines: int
    prompt_tokens: int | None
    # The most output tokens the lines allow (each line's limit, or the context left after its prompt, times `n`).
    max_output_tokens: int | None
    # Output tokens the lines give by earlier batches of the same model and endpoint, each line by its own cap: the
    # fewest and the most their answers allow, and the expected, the middle (all three equal where they tell).
    expected_output_tokens: int | None
    expected_output_tokens_low: int | None
    expected_output_tokens_high: int | None
    # Prompt tokens expected from the prefix cache: lines that share their long leading text (`app.domain.
    # input_index`) after the first of them.
    expected_cached_tokens: int | None
    expected_cached_share: float | None
    # Seconds the batch runs once it starts (not its wait for a turn), at the measured rate: for the expected, the
    # fewest and the most output tokens.
    eta_seconds: float | None
    eta_seconds_low: float | None
    eta_seconds_high: float | None
    gpu_seconds: float | None
    # With VBATCH_GPU_HOUR_PRICE set: gpu_seconds at that price.
    cost_usd: float | None
    gpu_hour_price: float | None
    basis: EstimateBasis


class CreateBatchRequest(BaseModel):
    # An argument OpenAI does not know is refused, as OpenAI refuses it: a misspelt one would be dropped unseen.
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


class Model(BaseModel):
    """OpenAI's Model object. A LoRA adapter's also has `parent`, as `vllm serve` lists adapters, but not vLLM's
    `root` (the adapter's path on the server's disk, which no key needs to see); a base model's has neither (the
    routes leave out fields that are None)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = Field(default=None, description="A LoRA adapter's base model (vLLM's extension).")


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
