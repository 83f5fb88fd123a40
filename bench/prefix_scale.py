"""Shared prefixes that outgrow the KV cache (docs/benchmarks.md, issue 6 goal 4), in one device call.

Many tasks, each a ~2,000-token instruction block, a few short rows each, the lines shuffled: more distinct
prefixes than the engine's cache holds, so the order the engine sees them in decides how often a block is
computed again. Three sides on the same file: a warm vbatch (which regroups lines by prefix), `vllm run-batch`
on the shuffled file, and `vllm run-batch` on the same lines pre-sorted by task (what ordering alone is worth).

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.prefix_scale --model $BENCH_MODEL \\
      --out /tmp/ps --results $OUT/prefix-scale.json
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench import compare, shapes
from bench.common import SideResults, VbatchServer, run_batch_through_sdk, warm_up


def prefix_lines(tasks: int, rows: int, rules: int, max_tokens: int) -> list[dict]:
    lines = []
    for task in range(tasks):
        block = shapes.instructions(task, rules)
        for row in range(rows):
            content = f"{block}\n\nTicket {task}-{row}: customer writes about issue {row * 31 % 1000}. Label:"
            lines.append(shapes.chat_line(f"t{task}-r{row}", content, max_tokens))
    return lines


def main() -> None:
    parser = compare.device_parser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--rules", type=int, default=60, help="rules per instruction block (60: ~2,000 tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sides", default="vbatch,run_batch_shuffled,run_batch_grouped")
    args = parser.parse_args()
    flags = compare.device_engine_flags(args)
    grouped = prefix_lines(args.tasks, args.rows, args.rules, args.max_tokens)
    shuffled = random.Random(1).sample(grouped, len(grouped))
    shuffled_file, grouped_file = (
        shapes.write_jsonl(args.out / "shuffled.jsonl", shuffled),
        shapes.write_jsonl(args.out / "grouped.jsonl", grouped),
    )
    meta = {**json.loads(args.meta), **{k: str(v) for k, v in vars(args).items()}, "lines": len(grouped)}
    side = SideResults(args.results, meta).side

    sides = args.sides.split(",")
    if "vbatch" in sides:
        vbatch_side(side, args.out, flags, shuffled_file)
    if "run_batch_shuffled" in sides:
        side("run_batch_shuffled", lambda: shapes.run_batch_prefix_side(shuffled_file, flags, args.out, timeout=400))
    if "run_batch_grouped" in sides:
        side("run_batch_grouped", lambda: shapes.run_batch_prefix_side(grouped_file, flags, args.out, timeout=300))


def vbatch_side(side, out: Path, flags: list[str], shuffled_file: Path) -> None:
    server = VbatchServer(out / "vbatch-data", 8127, flags, out / "vbatch-serve.log")
    try:
        side("vbatch_engine_start", lambda: {"s": round(server.wait_ready(timeout=300), 2)})
        warm_up(server.base_url, out, compare.SERVED, compare.SAMPLING)
        side("vbatch_shuffled", lambda: run_batch_through_sdk(server.base_url, shuffled_file, hammer=False).summary())
    finally:
        server.stop()


if __name__ == "__main__":
    main()
