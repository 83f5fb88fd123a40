"""The `vllm bench throughput` shape (issue 6 goal 3) with the GPU watched, in one device call: a warm vbatch runs
1,000 random 1,024-token prompts with 256 output tokens twice (the spread between two runs of one side), then
`vllm bench throughput` runs the same shape once. nvidia-smi samples GPU utilisation and power every 100 ms
during each side, to show whether the GPU or the host bounds them.

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.random_shape --model $BENCH_MODEL \\
      --out /tmp/rs --results $OUT/random-shape.json [--vbatch-flag=--disable-log-stats]

Each vbatch run also records the service's timeline for its batch (planned, all_sent, first_result, last_result,
published), which splits vbatch's seconds into its own work and the engine's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable

from bench import compare, shapes
from bench.common import SideResults, VbatchServer, measure, warm_up


def watched(measure: Callable[[], dict]) -> dict:
    """Runs a side while nvidia-smi samples; adds utilisation and power over the samples where the GPU was busy."""
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=utilization.gpu,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        result = measure()
    finally:
        sampler.terminate()
        samples = sampler.communicate(timeout=10)[0]
    rows = [tuple(float(x) for x in line.split(",")) for line in samples.splitlines() if line.count(",") == 1]
    busy = [row for row in rows if row[0] > 0]
    return {
        **result,
        "gpu_samples": len(rows),
        "gpu_busy_samples": len(busy),
        "gpu_util_mean_when_busy": round(statistics.mean(r[0] for r in busy), 1) if busy else None,
        "gpu_util_at_least_95_share": round(sum(r[0] >= 95 for r in busy) / len(busy), 3) if busy else None,
        "power_w_mean_when_busy": round(statistics.mean(r[1] for r in busy), 1) if busy else None,
    }


def main() -> None:
    parser = compare.device_parser()
    parser.add_argument(
        "--vbatch-flag", action="append", default=[], help="an extra engine flag for the vbatch side only (repeatable)"
    )
    args = parser.parse_args()
    flags = compare.device_engine_flags(args)
    random_file = args.out / "random.jsonl"
    shapes.random_token_batch(random_file, 1000, 1024, 256, vocab=150_000)
    side = SideResults(args.results, json.loads(args.meta)).side

    server = VbatchServer(args.out / "vbatch-data", 8129, flags + args.vbatch_flag, args.out / "vbatch-serve.log")
    try:
        side("vbatch_engine_start", lambda: {"s": round(server.wait_ready(timeout=300), 2)})
        warm_up(server.base_url, args.out, compare.SERVED, compare.SAMPLING)
        for run in (1, 2):
            side(
                f"vbatch_random_run{run}",
                lambda: watched(lambda: measure(server, random_file, "/v1/completions", hammer=False)),
            )
    finally:
        server.stop()
    side(
        "vllm_bench_throughput",
        lambda: watched(lambda: shapes.bench_throughput_side(args.model, args.max_model_len, args.out)),
    )


if __name__ == "__main__":
    main()
