"""How the console words and formats what the domain returns: times, sizes, durations, a batch's row."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from app.domain.cost import Spend
from app.domain.errors import InvalidRequest
from app.domain.lifecycle import TERMINAL, BatchStatus
from app.domain.models import FileRow
from app.domain.schemas import Batch, RunStats

# A batch's lifecycle timestamps, in the order a batch meets them: its creation, then the statuses it is stamped at.
STAMPED = (
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLED,
)
LIFECYCLE = (("created", "created_at"), *((status.replace("_", " "), f"{status}_at") for status in STAMPED))
ENDINGS = tuple(f"{status}_at" for status in TERMINAL)
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class BatchRowView:
    batch: Batch
    done: int
    total: int
    percent: int
    requests_per_second: float | None
    output_tokens_per_second: float | None
    eta_seconds: float | None
    ended_at: int | None
    final: bool
    spend: Spend  # what it used and cost so far (`app.domain.cost`)


def batch_row(batch: Batch, stats: RunStats | None, spend: Spend) -> BatchRowView:
    counts = batch.request_counts
    done = counts.completed + counts.failed
    ended = [getattr(batch, field) for field in ENDINGS if getattr(batch, field) is not None]
    return BatchRowView(
        batch=batch,
        done=done,
        total=counts.total,
        percent=round(100 * done / counts.total)
        if counts.total
        else (100 if batch.status == BatchStatus.COMPLETED else 0),
        requests_per_second=stats.requests_per_second if stats else None,
        output_tokens_per_second=stats.output_tokens_per_second if stats else None,
        eta_seconds=stats.eta_seconds if stats else None,
        ended_at=max(ended) if ended else None,
        final=batch.status in TERMINAL,
        spend=spend,
    )


def _empty_percent(batch: Batch) -> int:
    """A batch of no lines is all done once it has completed."""
    return 100 if batch.status == BatchStatus.COMPLETED else 0


def lifecycle(batch: Batch) -> list[tuple[str, int]]:
    return [(label, getattr(batch, field)) for label, field in LIFECYCLE if getattr(batch, field) is not None]


def run_stages(timeline: dict[str, float] | None) -> list[tuple[str, float]]:
    return sorted((timeline or {}).items(), key=lambda stage: stage[1])


def error_line(line: dict) -> dict:
    """One line of an error file as the console lists it: its id, code and message, wherever OpenAI puts them."""
    response = line.get("response") or {}
    error = line.get("error") or (response.get("body") or {}).get("error") or {}
    return {
        "custom_id": line.get("custom_id"),
        "status_code": response.get("status_code"),
        "code": error.get("code"),
        "message": error.get("message"),
    }


def parse_metadata(text: str) -> dict[str, str] | None:
    """`key=value`, one a line (blank lines ignored), as the submit form takes metadata."""
    pairs: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest(f"Metadata line {number} is not key=value.", param="metadata")
        pairs[key.strip()] = value.strip()
    return pairs or None


def download_name(row: FileRow) -> str:
    return _SAFE_NAME.sub("_", row.filename)[:200] or row.id


def when(timestamp: int | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def day_minute(timestamp: int | None) -> str:
    """A table's time: to the minute, UTC (the column says so)."""
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M")


def size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            break
        value /= 1000
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


@dataclass(frozen=True)
class Throughput:
    """The engine page's rates: the running batches' together, and the online requests this process answered."""

    batches_running: int
    batch_requests_per_second: float
    batch_output_tokens_per_second: float
    online_requests_per_second: float
    online_output_tokens_per_second: float


def throughput(batch_rates: dict[str, tuple[float, float]], online: tuple[float, float]) -> Throughput:
    """`batch_rates`: each running batch's (requests/s, output tokens/s); `online`: the same for online requests."""
    return Throughput(
        batches_running=len(batch_rates),
        batch_requests_per_second=sum(requests for requests, _ in batch_rates.values()),
        batch_output_tokens_per_second=sum(tokens for _, tokens in batch_rates.values()),
        online_requests_per_second=online[0],
        online_output_tokens_per_second=online[1],
    )


def gpu_seconds(value: float | None) -> str:
    """A batch's engine time: to the second, or the tenth below ten, as `duration` words its seconds."""
    return "-" if value is None else f"{value:,.1f} GPU-s" if value < 10 else f"{value:,.0f} GPU-s"


def usd(value: float | None) -> str:
    """A cost: cents, or four places below a cent (a small batch's cost is a fraction of one)."""
    if value is None:
        return "-"
    return f"${value:,.2f}" if value >= 0.01 or value == 0 else f"${value:.4f}"


def step_time(seconds: float | None) -> str:
    """An engine step's time: milliseconds, or seconds from one up."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def tokens(value: float | None) -> str:
    """Tokens a step, on average: whole from ten up, a tenth below (a few live prompt tokens a step show)."""
    return "-" if value is None else f"{value:,.0f}" if value >= 10 or value == 0 else f"{value:.1f}"


FILTERS = {
    "when": when,
    "day_minute": day_minute,
    "size": size,
    "duration": duration,
    "rate": rate,
    "gpu_seconds": gpu_seconds,
    "usd": usd,
    "step_time": step_time,
    "tokens": tokens,
}
