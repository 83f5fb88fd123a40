"""A batch's estimate before it runs (`POST /v1/batches/estimate`): the arithmetic, from the lines' prompt token
counts (the engine counts them, `app.engine.estimating`) and what this engine did on earlier batches of the same
model and endpoint.

Expected output is those batches' output tokens per line; the rate is their output tokens over their runs' seconds
(input tokens for an endpoint that generates none), so a file of the same shape as one that has run gets an output
and an ETA close to what it will do. Without such a batch both are null, and the basis says the rate is unknown.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core.db import session_scope
from app.domain.cost import cost_usd
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.domain.schemas import BatchErrors, BatchEstimate, EstimateBasis

# The earlier batches an estimate learns from: the most recent ones, so that it follows the engine as it is now.
HISTORY_BATCHES = 5
# The per-line field that bounds its output, by endpoint, in the order vLLM reads them (chat prefers
# max_completion_tokens), and the bound vLLM applies when a line gives none (None: the context left after the prompt).
_LIMIT_FIELDS = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}
_DEFAULT_LIMITS = {"/v1/completions": 16}
SCORING = ("/v1/score", "/v1/rerank")
GENERATES_NOTHING = ("/v1/embeddings", *SCORING)
# The two sides a score body pairs, in the spellings vLLM's ScoreRequest takes (the first present wins, as there).
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


def scored_texts(endpoint: str, body: dict) -> list[str] | None:
    """The texts a scoring line's pairs put before the model, each pair's two (one side given once pairs with
    each of the other's); None where they are not all text (images, a shape the handler refuses)."""
    sides = [("query", "documents")] if endpoint == "/v1/rerank" else _SCORE_SIDES
    first, second = next(((body[a], body[b]) for a, b in sides if a in body and b in body), (None, None))
    firsts = first if isinstance(first, list) else [first]
    seconds = second if isinstance(second, list) else [second]
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        return None
    texts = [text for pair in zip(firsts, seconds, strict=True) for text in pair]
    return texts if texts and all(isinstance(text, str) for text in texts) else None


@dataclass(frozen=True)
class PromptCount:
    """One line's prompt as the engine would take it: its tokens, and how many of them its prefix cache is expected
    to hold when the line runs (`cached_prefix_tokens`)."""

    tokens: int
    cached: int = 0


def cached_prefix_tokens(prompts: Iterable[tuple[Hashable, Sequence[Hashable]] | None], block_size: int) -> list[int]:
    """For each (salt, token ids) in order, the tokens vLLM's automatic prefix cache would give it from the prompts
    before it, found as the engine finds them: whole blocks of `block_size` tokens from the start, each known by every
    token up to its end and by the salt (a LoRA adapter, a `cache_salt`: prompts of two never share a block), and
    never the last token, which the engine always computes. It takes the cache to keep every block the prompts share
    (a cache smaller than those does not); lines that run together share as the engine's steps do: a block is
    cached once scheduled."""
    seen: set[int] = set()
    cached = []
    for prompt in prompts:
        hits = 0
        if prompt is not None:
            salt, tokens = prompt
            key, matching = hash(salt), True
            for end in range(block_size, len(tokens) + 1, block_size):
                key = hash((key, *tokens[end - block_size : end]))
                matching = matching and end < len(tokens) and key in seen
                hits += matching
                seen.add(key)
        cached.append(hits * block_size)
    return cached


@dataclass(frozen=True)
class Line:
    """What the estimate needs of one request line."""

    prompt_tokens: int
    # Output tokens the line allows at most (its limit, or the context left after the prompt), all choices together.
    max_output_tokens: int
    cached_tokens: int


def line_of(endpoint: str, body: dict, count: PromptCount, max_model_len: int) -> Line:
    return Line(
        prompt_tokens=count.tokens,
        max_output_tokens=max_output_tokens(endpoint, body, count.tokens, max_model_len),
        cached_tokens=count.cached,
    )


def max_output_tokens(endpoint: str, body: dict, prompt_tokens: int, max_model_len: int) -> int:
    if endpoint in GENERATES_NOTHING:
        return 0
    room = max(0, max_model_len - prompt_tokens)
    limits = [body.get(name) for name in _LIMIT_FIELDS.get(endpoint, ())]
    limit = next((value for value in limits if isinstance(value, int) and value > 0), None)
    limit = limit if limit is not None else _DEFAULT_LIMITS.get(endpoint)
    n = body.get("n")
    choices = n if isinstance(n, int) else 1
    return (room if limit is None else min(limit, room)) * choices


@dataclass(frozen=True)
class History:
    """Earlier completed batches of one model and endpoint, summed."""

    batch_ids: list[str]
    lines: int
    input_tokens: int
    output_tokens: int
    run_seconds: float

    def output_per_line(self) -> float | None:
        return self.output_tokens / self.lines if self.lines else None

    def tokens_per_second(self, generates: bool) -> float | None:
        tokens = self.output_tokens if generates else self.input_tokens
        return tokens / self.run_seconds if tokens and self.run_seconds > 0 else None


def run_seconds(timeline_json: str | None) -> float:
    """Seconds a batch's last run took to its last result (`app.engine.meter`'s timeline; 0 if it kept none)."""
    timeline = json.loads(timeline_json) if timeline_json else {}
    return float(timeline.get("last_result", 0.0))


def history_of(rows: Sequence[BatchRow]) -> History:
    return History(
        batch_ids=[row.id for row in rows],
        lines=sum(row.completed for row in rows),
        input_tokens=sum(row.input_tokens for row in rows),
        output_tokens=sum(row.output_tokens for row in rows),
        run_seconds=sum(run_seconds(row.timeline_json) for row in rows),
    )


def recent_history(
    *, db: Engine, model: str | None, endpoint: str, lines: int, wave: int | None, limit: int = HISTORY_BATCHES
) -> History:
    """The newest completed batches of `model` and `endpoint` that ran lines and timed their run (shards are counted
    through their parent: a parent's totals are its shards' summed), of those the ones comparable to a file of
    `lines` (`comparable`)."""
    with session_scope(db) as session:
        statement = (
            select(BatchRow)
            .where(
                col(BatchRow.status) == BatchStatus.COMPLETED,
                col(BatchRow.model) == model,
                col(BatchRow.endpoint) == endpoint,
                col(BatchRow.parent_id).is_(None),
                col(BatchRow.completed) > 0,
                col(BatchRow.timeline_json).is_not(None),
            )
            .order_by(col(BatchRow.created_ns).desc())
            .limit(limit)
        )
        rows = list(session.exec(statement).all())
    timed = [row for row in rows if run_seconds(row.timeline_json) > 0]
    return history_of(comparable(timed, lines=lines, wave=wave))


def comparable(rows: Sequence[BatchRow], *, lines: int, wave: int | None) -> list[BatchRow]:
    """The batches that kept the engine as full as a file of `lines` will: at least a wave of lines (the requests
    the engine runs at once), or as many as the file has. A batch of a few lines runs at a fraction of a full
    engine's rate, and would make a large file's ETA long (on an H100, an 8-line warm-up beside a 2,000-line batch
    took 21% off the rate). All of them where none is."""
    if not wave:
        return list(rows)
    full = [row for row in rows if row.completed >= min(lines, wave)]
    return full or list(rows)


def gpu_seconds(run_seconds: float, gpus: int) -> float:
    """Seconds the engine runs the batch, on each of the GPUs it holds."""
    return run_seconds * max(1, gpus)


@dataclass(frozen=True)
class Asked:
    input_file_id: str
    endpoint: str
    model: str | None


@dataclass(frozen=True)
class Pricing:
    """The GPUs the engine holds and the price of one an hour (None: no price set)."""

    gpus: int
    gpu_hour_price: float | None


def refused(asked: Asked, lines: int, errors: BatchErrors, pricing: Pricing) -> BatchEstimate:
    """The estimate of a file that would fail validation: its errors, no figures."""
    return BatchEstimate(
        input_file_id=asked.input_file_id,
        endpoint=asked.endpoint,
        model=asked.model,
        errors=errors,
        lines=lines,
        prompt_tokens=None,
        max_output_tokens=None,
        expected_output_tokens=None,
        expected_cached_tokens=None,
        expected_cached_share=None,
        eta_seconds=None,
        gpu_seconds=None,
        cost_usd=None,
        gpu_hour_price=pricing.gpu_hour_price,
        basis=_basis(None, History([], 0, 0, 0, 0.0), asked.endpoint, pricing),
    )


def estimate(
    asked: Asked, line_count: int, lines: Sequence[Line] | None, history: History, pricing: Pricing
) -> BatchEstimate:
    """`lines`: each line's counts, None when no engine here could count them (then only what needs no count)."""
    generates = asked.endpoint not in GENERATES_NOTHING
    per_line = history.output_per_line() if generates else 0.0
    expected = None if per_line is None else round(per_line * line_count)
    prompt = None if lines is None else sum(line.prompt_tokens for line in lines)
    cached = None if lines is None else sum(line.cached_tokens for line in lines)
    rate = history.tokens_per_second(generates)
    work = expected if generates else prompt
    eta = None if rate is None or work is None else work / rate
    gpu = None if eta is None else gpu_seconds(eta, pricing.gpus)
    return BatchEstimate(
        input_file_id=asked.input_file_id,
        endpoint=asked.endpoint,
        model=asked.model,
        errors=None,
        lines=line_count,
        prompt_tokens=prompt,
        max_output_tokens=None if lines is None else sum(line.max_output_tokens for line in lines),
        expected_output_tokens=expected,
        expected_cached_tokens=cached,
        expected_cached_share=None if not prompt or cached is None else round(cached / prompt, 4),
        eta_seconds=None if eta is None else round(eta, 3),
        gpu_seconds=None if gpu is None else round(gpu, 3),
        cost_usd=None if gpu is None else cost_usd(gpu, pricing.gpu_hour_price),
        gpu_hour_price=pricing.gpu_hour_price,
        basis=_basis(lines, history, asked.endpoint, pricing),
    )


def _basis(lines: Sequence[Line] | None, history: History, endpoint: str, pricing: Pricing) -> EstimateBasis:
    generates = endpoint not in GENERATES_NOTHING
    rate = history.tokens_per_second(generates)
    return EstimateBasis(
        token_counts="unknown" if lines is None else "tokenizer",
        history_batch_ids=history.batch_ids,
        rate="unknown" if rate is None else "measured",
        tokens_per_second=None if rate is None else round(rate, 2),
        rate_unit=None if rate is None else ("output_tokens" if generates else "input_tokens"),
        gpus=max(1, pricing.gpus),
    )
