"""Memory follows what is in flight, not the file: one warm service runs a small and a very large input of short
prompts (`max_tokens: 1`) and reports the peak RSS of the service process (API, loop, result writing) and of its
engine processes during each run.

  python3 -m bench.memory --model MODEL [--dummy] [--eager] --sizes 2000,200000 --out /tmp/m --results m.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import psutil

from bench import compare
from bench.common import VbatchServer, run_batch_through_sdk


def short_prompt_batch(path: Path, count: int) -> None:
    with path.open("w") as out:
        for i in range(count):
            body = {
                "model": compare.SERVED,
                "messages": [{"role": "user", "content": f"Label item {i}: is it a fruit or a tool?"}],
                "max_tokens": 1,
            }
            out.write(json.dumps({"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")  # fmt: skip


class PeakRSS:
    """Samples the service process and its children every 0.2 s (a peak between samples can be missed)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.service_mb = 0.0
        self.engine_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                service = self.process.memory_info().rss
                children = sum(c.memory_info().rss for c in self.process.children(recursive=True))
            except psutil.Error:
                continue
            self.service_mb = max(self.service_mb, service / 2**20)
            self.engine_mb = max(self.engine_mb, children / 2**20)
            time.sleep(0.2)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dummy", action="store_true")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--sizes", default="2000,200000")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--meta", default="{}")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    env = {"VBATCH_MAX_REQUESTS_PER_BATCH": str(max(sizes))}
    server = VbatchServer(args.out / "data", 8127, compare.engine_flags(args), args.out / "serve.log", env=env)
    results: dict = {"meta": json.loads(args.meta), "runs": []}
    try:
        results["engine_start_s"] = round(server.wait_ready(timeout=600), 1)
        idle = psutil.Process(server.process.pid).memory_info().rss / 2**20
        results["service_idle_rss_mb"] = round(idle, 1)
        for size in sizes:
            path = args.out / f"short-{size}.jsonl"
            short_prompt_batch(path, size)
            with PeakRSS(server.process.pid) as peak:
                run = run_batch_through_sdk(server.base_url, path, hammer=False, timeout=3600)
            row = {
                "lines": size,
                "input_mb": round(path.stat().st_size / 2**20, 1),
                "service_peak_rss_mb": round(peak.service_mb, 1),
                "engine_peak_rss_mb": round(peak.engine_mb, 1),
                "turnaround_s": round(run.turnaround_s, 1),
                "requests_per_s": round(size / run.generating_s, 1),
                "completed": run.completed,
                "failed": run.failed,
            }
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            args.results.write_text(json.dumps(results, indent=2))
    finally:
        server.stop()
    print(f"{'lines':>8} {'input MB':>9} {'service peak RSS MB':>20} {'engine RSS MB':>14} {'turnaround s':>13}")
    for row in results["runs"]:
        print(f"{row['lines']:>8} {row['input_mb']:>9} {row['service_peak_rss_mb']:>20} "
              f"{row['engine_peak_rss_mb']:>14} {row['turnaround_s']:>13}")  # fmt: skip


if __name__ == "__main__":
    main()
