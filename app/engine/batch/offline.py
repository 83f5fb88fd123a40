"""`vbatch run`: one input file through a fresh engine, with the service's line formats, its result sink and a
progress bar. An interrupted run resumes from its own output files: finished custom_ids are not sent again."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from app.domain.adapters import parents
from app.domain.batches import Progress
from app.domain.input_index import InputIndex
from app.domain.results import Outcome
from app.domain.validation import Limits, numbered_lines, validate_file
from app.engine.batch.ordering import adapter_gate, ordered_lines, pin_to_ranks, plan
from app.engine.batch.parts import ResultSink
from app.engine.inference.serving import EngineFactory, Serving, engine_wave, max_loras
from app.engine.sharing.execution import FixedSlots, run_lines

DEFAULT_ENDPOINT = "/v1/chat/completions"
MAX_REQUESTS = 10_000_000  # the offline runner has no OpenAI quota to mirror
CHECKPOINT_SECONDS = 1.0


class Progressbar:
    def __init__(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="req", desc="vbatch run", mininterval=1.0, file=sys.stderr)
        self.started = time.monotonic()
        self.output_tokens_before = 0

    def update(self, progress: Progress) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = (progress.output_tokens - self.output_tokens_before) / elapsed
        self.bar.set_postfix_str(f"{rate:.0f} out tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class ForeignResults(Exception):
    """The output file holds results of another input."""


async def run_file(factory: EngineFactory, *, input_path: Path, output: Path, errors: Path) -> int:
    async with factory() as serving:
        endpoint = _endpoint_of(input_path)
        limits = Limits(
            endpoint=endpoint,
            served_models=frozenset(serving.served_models),
            parents=parents(serving.adapters),
            max_requests=MAX_REQUESTS,
            max_line_bytes=1 << 30,
        )
        report = await asyncio.to_thread(validate_file, input_path, limits)
        if not report.ok:
            for error in report.errors:
                print(f"line {error.line}: {error.code}: {error.message}", file=sys.stderr)
            return 2
        sink = ResultSink(output, errors)
        try:
            await sink.open(output_bytes=None, error_bytes=None, position_of=lambda: _positions(report.index))
        except ForeignResults as exc:
            print(f"{exc}: remove them or write elsewhere (-o, --error-file)", file=sys.stderr)
            return 2
        if sink.done:
            print(f"resuming: {len(sink.done)} of {report.total} requests already done in {output}", file=sys.stderr)
        started = time.monotonic()
        await _run(serving, sink, input_path, report.index, endpoint, bar=Progressbar(report.total, len(sink.done)))
        elapsed = time.monotonic() - started
        progress = sink.progress
        print(
            f"{progress.completed} succeeded, {progress.failed} failed, {progress.output_tokens} output tokens "
            f"({progress.output_tokens / max(elapsed, 1e-6):.1f} output tokens/s over {elapsed:.1f} s of this run)",
            file=sys.stderr,
        )
        return 0


async def _run(
    serving: Serving, sink: ResultSink, input_path: Path, index: InputIndex, endpoint: str, bar: Progressbar
):
    """Every line not yet done, with the sink checkpointed (fsynced) every CHECKPOINT_SECONDS, so that an
    interrupted run loses at most that much work."""
    bar.output_tokens_before = sink.progress.output_tokens

    def record(position: int, outcome: Outcome) -> None:
        sink.record(position, outcome)
        bar.update(sink.progress)

    async def checkpoints() -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_SECONDS)
            await sink.checkpoint()

    ticker = asyncio.create_task(checkpoints())
    in_flight = engine_wave(serving) * 2
    try:
        groups = await asyncio.to_thread(plan, index)
        pin_to_ranks(groups, serving.data_parallel_size)
        await run_lines(
            ordered_lines(input_path, index, groups, skip=sink.done),
            executor=serving,
            endpoint=endpoint,
            slots=FixedSlots(in_flight),
            workers=in_flight,
            on_outcome=record,
            gate=adapter_gate(index, max_loras(serving)),
        )
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        await sink.checkpoint()
        await sink.close()
        bar.close()


def _positions(index: InputIndex) -> dict[str, int]:
    positions = index.position_of()

    class Checked(dict):
        def __missing__(self, custom_id: str) -> int:
            raise ForeignResults(f"the results already there name custom_id {custom_id!r}, which the input lacks")

    return Checked(positions)


def _endpoint_of(input_path: Path) -> str:
    """`vllm run-batch` has no batch object: the first line's url names the endpoint every line must use."""
    for line in numbered_lines(input_path):
        try:
            url = json.loads(line.data).get("url")
        except (ValueError, AttributeError):
            url = None
        return url if isinstance(url, str) else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT
