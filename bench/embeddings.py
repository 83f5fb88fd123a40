"""Embeddings (issue 17) in one device call: 20,000 short `/v1/embeddings` lines through a warm `vbatch serve
--runner pooling`, then `LLM.embed` on the same engine flags in a process of its own (warm, items of its own).

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.embeddings --model $BENCH_MODEL --out /tmp/e \\
      --results $OUT/embeddings.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench import compare
from bench.common import SideResults, VbatchServer, leave_now, measure, run_batch_through_sdk, run_logged

LINES = 20_000


def text(n: int) -> str:
    return f"Item {n}: a short product title to embed for search, row {n * 7 % 1000}."


def write_embeddings(path: Path, first: int) -> Path:
    with path.open("w") as out:
        for n in range(first, first + LINES):
            body = {"model": compare.SERVED, "input": text(n)}
            out.write(
                json.dumps({"custom_id": f"e{n}", "method": "POST", "url": "/v1/embeddings", "body": body}) + "\n"
            )
    return path


def vbatch_side(args, path: Path, warm: Path, side) -> None:
    flags = [*compare.device_vbatch_flags(args), "--runner", "pooling"]
    server = VbatchServer(args.out / "vbatch-data", 8129, flags, args.out / "vbatch-serve.log")
    try:
        side("vbatch_engine_start", lambda: {"s": round(server.wait_ready(timeout=400), 2)})
        run_batch_through_sdk(server.base_url, warm, "/v1/embeddings", hammer=False)

        def measured() -> dict:
            summary = measure(server, path, "/v1/embeddings", hammer=False)
            return {**summary, "requests_per_s": round(summary["completed"] / summary["turnaround_s"], 1)}

        side("vbatch_embeddings", measured)
    finally:
        server.stop()


def engine_side(args) -> None:
    from vllm import LLM

    llm = LLM(model=args.model, max_model_len=args.max_model_len, load_format="dummy", runner="pooling")
    llm.embed([text(n) for n in range(10 * LINES, 10 * LINES + 64)], use_tqdm=False)
    prompts = [text(n) for n in range(LINES)]
    started = time.perf_counter()
    outputs = llm.embed(prompts, use_tqdm=False)
    seconds = time.perf_counter() - started
    assert len(outputs) == LINES
    print(
        json.dumps(
            {"llm_embed": {"prompts": LINES, "seconds": round(seconds, 2), "requests_per_s": round(LINES / seconds, 1)}}
        ),
        flush=True,
    )
    leave_now()


def main() -> None:
    parser = compare.device_parser()
    parser.add_argument("--engine-side", action="store_true")
    parser.add_argument("--vbatch-only", action="store_true", help="leave out the LLM.embed side")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine_side:
        engine_side(args)
        return
    side = SideResults(
        args.results, {**json.loads(args.meta), "lines": LINES, "api_server_count": args.api_server_count}
    ).side
    path = write_embeddings(args.out / "embeddings.jsonl", first=LINES)
    warm = args.out / "warm.jsonl"
    write_embeddings_warm(warm)
    vbatch_side(args, path, warm, side)
    if args.vbatch_only:
        return
    command = [sys.executable, "-m", "bench.embeddings", "--engine-side", "--model", args.model, "--out",
               str(args.out), "--results", str(args.results), "--max-model-len", str(args.max_model_len)]  # fmt: skip
    stdout = run_logged(command, args.out / "llm.log", timeout=300)
    for line in stdout.splitlines():
        if line.startswith("{"):
            for name, value in json.loads(line).items():
                side(name, lambda value=value: value)
    data = json.loads(args.results.read_text())["sides"]
    v, e = data.get("vbatch_embeddings", {}), data.get("llm_embed", {})
    if v.get("requests_per_s") and e.get("requests_per_s"):
        print(f"embeddings: vbatch {v['requests_per_s']} / LLM.embed {e['requests_per_s']} = "
              f"{v['requests_per_s'] / e['requests_per_s']:.2f}x")  # fmt: skip


def write_embeddings_warm(path: Path) -> None:
    with path.open("w") as out:
        for n in range(5 * LINES, 5 * LINES + 16):
            body = {"model": compare.SERVED, "input": text(n)}
            out.write(
                json.dumps({"custom_id": f"w{n}", "method": "POST", "url": "/v1/embeddings", "body": body}) + "\n"
            )


if __name__ == "__main__":
    main()
