"""A batch's estimate before it runs (`POST /v1/batches/estimate`): the arithmetic, from the lines' prompt token
counts (the engine counts them, `app.engine.online.estimating`) and what this engine did on earlier batches of the same
model and endpoint.

Expected output is what those batches' answers say of each line's own cap: an answer that ended on its own gives as
much again while the line's cap lets it, one cut at its cap (finish_reason `length`) says only that it would have run
at least so long. So the output is a range, a single figure where the history tells (its answers ended below the
file's caps, or were cut at caps no lower), and the estimate is its middle. The rate is their output tokens over
their runs' seconds (input tokens for an endpoint that generates none), so a file of the same shape as one that has
run gets an output and an ETA close to what it will do. Without such a batch both are null, and the basis says the
rate is unknown.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from app.core.db import session_scope
from app.domain.cost import cost_usd
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.domain.schemas import BatchErrors, BatchEstimate, EstimateBasis, OutputKnown

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
    """Earlier completed batches of one model and endpoint, summed; how their answers ended as `Progress` keeps it
    (those cut at their cap, their tokens, the fewest tokens of a cut answer and the most of one that was not)."""

    batch_ids: list[str]
    lines: int
    input_tokens: int
    output_tokens: int
    run_seconds: float
    cut_lines: int = 0
    cut_output_tokens: int = 0
    shortest_cut_output: int = 0
    longest_uncut_output: int = 0

    def output_range(self, cap: int) -> tuple[float, float]:
        """The fewest and the most output tokens a line whose cap is `cap` gives, by the history's answers (one
        history line's worth). An answer that ended on its own gives as much again, cut at `cap` where it ran past
        it: by at most its own excess, at least in proportion (x tokens of at most `longest` give at least x * cap /
        longest). An answer cut at its cap would have run at least that long: at least that, at most `cap`."""
        uncut_lines, uncut_tokens = self.lines - self.cut_lines, self.output_tokens - self.cut_output_tokens
        if cap >= self.longest_uncut_output:
            low, high = float(uncut_tokens), float(uncut_tokens)
        else:
            low, high = uncut_tokens * cap / self.longest_uncut_output, float(min(uncut_tokens, uncut_lines * cap))
        low += self.cut_lines * min(self.shortest_cut_output, cap)
        high += self.cut_lines * cap
        return low / self.lines, high / self.lines

    def tokens_per_second(self, generates: bool) -> float | None:
        tokens = self.output_tokens if generates else self.input_tokens
        return tokens / self.run_seconds if tokens and self.run_seconds > 0 else None


def run_seconds(timeline_json: str | None) -> float:
    """Seconds a batch's last run took to its last result (`app.engine.batch.meter`'s timeline; 0 if it kept none)."""
    timeline = json.loads(timeline_json) if timeline_json else {}
    return float(timeline.get("last_result", 0.0))


def history_of(rows: Sequence[BatchRow]) -> History:
    cut = [row.shortest_cut_output for row in rows if row.cut_lines]
    return History(
        batch_ids=[row.id for row in rows],
        lines=sum(row.completed for row in rows),
        input_tokens=sum(row.input_tokens for row in rows),
        output_tokens=sum(row.output_tokens for row in rows),
        run_seconds=sum(run_seconds(row.timeline_json) for row in rows),
        cut_lines=sum(row.cut_lines for row in rows),
        cut_output_tokens=sum(row.cut_output_tokens for row in rows),
        shortest_cut_output=min(cut, default=0),
        longest_uncut_output=max((row.longest_uncut_output for row in rows), default=0),
    )


def recent_history(
    *,
    db: Engine,
    model: str | None,
    endpoint: str,
    lines: int,
    wave: int | None,
    caps: Sequence[int] = (),
    limit: int = HISTORY_BATCHES,
) -> History:
    """The newest completed batches of `model` and `endpoint` that ran lines and timed their run (shards are counted
    through their parent: a parent's totals are its shards' summed), of those the ones that tell a file whose lines'
    caps are `caps` (`telling`), and of those the ones comparable to a file of `lines` (`comparable`)."""
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
    return history_of(comparable(telling(timed, caps), lines=lines, wave=wave))


def telling(rows: Sequence[BatchRow], caps: Sequence[int]) -> list[BatchRow]:
    """The batches whose answers tell what lines capped at `caps` give, to the token: none cut below the highest
    cap (a cut answer says only that it would have run at least so long) and none that ended on its own past the
    lowest (the cap would cut it, by an amount unknown); their rate is of answers as long as the file's. All of them
    where none does (the output is then a range)."""
    if not caps:
        return list(rows)
    lowest, highest = min(caps), max(caps)
    exact = [
        row
        for row in rows
        if (row.cut_lines == 0 or row.shortest_cut_output >= highest) and row.longest_uncut_output <= lowest
    ]
    return exact or list(rows)


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
        expected_output_tokens_low=None,
        expected_output_tokens_high=None,
        expected_cached_tokens=None,
        expected_cached_share=None,
        eta_seconds=None,
        eta_seconds_low=None,
        eta_seconds_high=None,
        gpu_seconds=None,
        cost_usd=None,
        gpu_hour_price=pricing.gpu_hour_price,
        basis=_basis(None, History([], 0, 0, 0, 0.0), asked.endpoint, pricing, None),
    )


@dataclass(frozen=True)
class Output:
    """A file's output tokens by the history: the fewest, the expected (the middle) and the most, and why the
    history cannot tell one figure (None: it can)."""

    low: int
    expected: int
    high: int
    why: str | None = None


def output_of(history: History, caps: Sequence[int] | None, line_count: int) -> Output | None:
    """`caps`: each line's output cap (None: not known; then the history's output per line, as it was). None with
    no history."""
    if not history.lines:
        return None
    if caps is None:
        each = round(history.output_tokens / history.lines * line_count)
        return Output(each, each, each)
    low = high = 0.0
    for cap, count in Counter(caps).items():
        each_low, each_high = history.output_range(cap)
        low, high = low + each_low * count, high + each_high * count
    found = Output(round(low), round((low + high) / 2), round(high))
    return (
        found if found.low == found.high else Output(found.low, found.expected, found.high, _why_a_range(history, caps))
    )


def _why_a_range(history: History, caps: Sequence[int]) -> str:
    reasons = []
    if history.cut_lines and max(caps) > history.shortest_cut_output:
        reasons.append(
            f"{history.cut_lines} of the {history.lines} answers of those batches stopped at their cap, after as "
            f"few as {history.shortest_cut_output} output tokens, and this file's lines allow up to {max(caps)}: "
            "such an answer tells only that it would have run at least that long"
        )
    if history.longest_uncut_output > min(caps):
        reasons.append(
            f"answers of those batches that ended on their own ran to {history.longest_uncut_output} output tokens, "
            f"past the cap of this file's lines (as low as {min(caps)}): how many it cuts is not known"
        )
    return "; ".join(reasons) + ". The expected output is the middle of the range."


@dataclass(frozen=True)
class Timing:
    """Seconds the batch runs (the expected, the fewest and the most), and GPU-seconds of the expected."""

    eta: float | None
    low: float | None
    high: float | None
    gpu: float | None

    @staticmethod
    def of(work: Sequence[int] | None, rate: float | None, gpus: int) -> Timing:
        """`work`: the expected, fewest and most tokens at `rate` (tokens per second)."""
        if work is None or rate is None:
            return Timing(None, None, None, None)
        eta, low, high = (round(tokens / rate, 3) for tokens in work)
        return Timing(eta, low, high, round(gpu_seconds(work[0] / rate, gpus), 3))


def estimate(
    asked: Asked,
    line_count: int,
    lines: Sequence[Line] | None,
    history: History,
    pricing: Pricing,
    caps: Sequence[int] | None = None,
) -> BatchEstimate:
    """`lines`: each line's counts, None when no engine here could count them (then only what needs no count);
    `caps`: each line's output cap (by default, `lines`' `max_output_tokens`)."""
    generates = asked.endpoint not in GENERATES_NOTHING
    caps = caps if caps is not None or lines is None else [line.max_output_tokens for line in lines]
    output = output_of(history, caps, line_count) if generates else Output(0, 0, 0)
    prompt = None if lines is None else sum(line.prompt_tokens for line in lines)
    cached = None if lines is None else sum(line.cached_tokens for line in lines)
    if generates:
        work = None if output is None else (output.expected, output.low, output.high)
    else:
        work = None if prompt is None else (prompt, prompt, prompt)
    timing = Timing.of(work, history.tokens_per_second(generates), pricing.gpus)
    return BatchEstimate(
        input_file_id=asked.input_file_id,
        endpoint=asked.endpoint,
        model=asked.model,
        errors=None,
        lines=line_count,
        prompt_tokens=prompt,
        max_output_tokens=None if lines is None else sum(line.max_output_tokens for line in lines),
        expected_output_tokens=None if output is None else output.expected,
        expected_output_tokens_low=None if output is None else output.low,
        expected_output_tokens_high=None if output is None else output.high,
        expected_cached_tokens=cached,
        expected_cached_share=None if not prompt or cached is None else round(cached / prompt, 4),
        eta_seconds=timing.eta,
        eta_seconds_low=timing.low,
        eta_seconds_high=timing.high,
        gpu_seconds=timing.gpu,
        cost_usd=None if timing.gpu is None else cost_usd(timing.gpu, pricing.gpu_hour_price),
        gpu_hour_price=pricing.gpu_hour_price,
        basis=_basis(lines, history, asked.endpoint, pricing, output),
    )


def _basis(
    lines: Sequence[Line] | None, history: History, endpoint: str, pricing: Pricing, output: Output | None
) -> EstimateBasis:
    generates = endpoint not in GENERATES_NOTHING
    rate = history.tokens_per_second(generates)
    if not generates:
        known: OutputKnown = "none"
    else:
        known = "unknown" if output is None else ("measured" if output.why is None else "range")
    return EstimateBasis(
        token_counts="unknown" if lines is None else "tokenizer",
        history_batch_ids=history.batch_ids,
        history_lines=history.lines,
        history_cut_lines=history.cut_lines,
        output=known,
        output_reason=None if output is None else output.why,
        rate="unknown" if rate is None else "measured",
        tokens_per_second=None if rate is None else round(rate, 2),
        rate_unit=None if rate is None else ("output_tokens" if generates else "input_tokens"),
        gpus=max(1, pricing.gpus),
    )
