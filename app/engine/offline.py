"""`vbatch run`: one input file through a fresh engine, with the service's line formats and a progress bar."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from app.batches import Progress
from app.engine.execution import run_lines
from app.engine.ordering import ordered_lines, plan
from app.engine.vllm_adapter import live_engine
from app.results import Outcome, add_usage, line_for
from app.storage import ResultAppender
from app.validation import Limits, numbered_lines, validate_file

DEFAULT_ENDPOINT = "/v1/chat/completions"
MAX_REQUESTS = 10_000_000  # the offline runner has no OpenAI quota to mirror


class Progressbar:
    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc="vbatch run", mininterval=1.0, file=sys.stderr)
        self.started = time.monotonic()

    def update(self, progress: Progress) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        self.bar.set_postfix_str(f"{progress.output_tokens / elapsed:.0f} out tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def run_file(args: argparse.Namespace, *, input_path: Path, output: Path, errors: Path) -> int:
    async with live_engine(args) as serving:
        endpoint = _endpoint_of(input_path)
        limits = Limits(
            endpoint=endpoint,
            served_models=frozenset(serving.served_models),
            max_requests=MAX_REQUESTS,
            max_line_bytes=1 << 30,
        )
        report = await asyncio.to_thread(validate_file, input_path, limits)
        if not report.ok:
            for error in report.errors:
                print(f"line {error.line}: {error.code}: {error.message}", file=sys.stderr)
            return 2
        progress = Progress()
        bar = Progressbar(report.total)
        writers = {True: ResultAppender(output), False: ResultAppender(errors)}
        for writer in writers.values():
            writer.path.unlink(missing_ok=True)
            await writer.open()

        def record(_number: int, outcome: Outcome) -> None:
            writers[outcome.succeeded].add(line_for(outcome))
            progress.completed += outcome.succeeded
            progress.failed += not outcome.succeeded
            add_usage(progress, outcome.body)
            bar.update(progress)

        started = time.monotonic()
        in_flight = serving.max_num_seqs * 2
        groups = await asyncio.to_thread(plan, input_path)
        await run_lines(
            ordered_lines(input_path, groups, skip=set()),
            executor=serving,
            endpoint=endpoint,
            slots=asyncio.Semaphore(in_flight),
            workers=in_flight,
            on_outcome=record,
        )
        for writer in writers.values():
            await writer.close()
        bar.close()
        elapsed = time.monotonic() - started
        print(
            f"{progress.completed} succeeded, {progress.failed} failed, {progress.output_tokens} output tokens "
            f"in {elapsed:.1f} s ({progress.output_tokens / max(elapsed, 1e-6):.1f} output tokens/s)",
            file=sys.stderr,
        )
        return 0


def _endpoint_of(input_path: Path) -> str:
    """`vllm run-batch` has no batch object: the first line's url names the endpoint every line must use."""
    for _number, line in numbered_lines(input_path):
        try:
            url = json.loads(line).get("url")
        except (ValueError, AttributeError):
            url = None
        return url if isinstance(url, str) else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT
