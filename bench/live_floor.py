"""A live first token beside a batch as it starts (issue 39), on one `vbatch serve` (the CPU shape; runs anywhere).

Three phases on one engine, warm, in this order:
  idle     the live client alone: `--live` streamed chat requests, one every `--every` seconds.
  alone    the batch alone: `--lines` of the seed's tickets through the openai SDK, created to completed.
  beside   the same batch again (new prompts), and the live client started the moment the engine runs the batch's
           first lines (vLLM's `num_requests_running` seen above 0 on /metrics): a live request sent just after a
           batch starts, the case where the batch's whole first wave used to go first.
Each live request is timed from its send to its first streamed token (`bench.online_load`). `--runs` repeats the
idle and beside phases (the batch alone once). The engine's step series (`vbatch_engine_step_*`, where the code
has them) are read from /metrics at the end of each phase.

CPU (2 cores, the default model, ~4 minutes):
  flock /tmp/vbatch-engine.lock .venv/bin/python -m bench.live_floor --out /tmp/lf \\
      --results bench/results/cpu-live-floor-<commit>.json --meta '{"machine": "cpu, 2 cores", "commit": "..."}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from app.testing import free_port
from bench.common import VbatchServer, run_batch_through_sdk, warm_up, write_ticket_batch
from bench.online_load import AUTH, online_bodies, open_loop, percentile, raw_rows, series_total

SERVED = "bench-model"
SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
CHAT = "/v1/chat/completions"
STEP_SERIES = ("vbatch_engine_steps_total", "vbatch_engine_step_seconds_sum", "vbatch_engine_step_tokens_total")


def ttft_summary(answers: list) -> dict:
    ttft = [t for a in answers if (t := a.ttft()) is not None]

    def ms(q: float) -> float | None:
        value = percentile(ttft, q)
        return None if value is None else round(value * 1000, 1)

    return {"sent": len(answers), "answered": len(ttft), "ttft_p50_ms": ms(0.5), "ttft_p90_ms": ms(0.9),
            "ttft_max_ms": ms(1.0), "requests": raw_rows(answers)}  # fmt: skip


def live_client(base_url: str, bodies: list[dict], every: float) -> dict:
    schedule = [i * every for i in range(len(bodies))]
    start = time.monotonic()
    answers = asyncio.run(open_loop(f"{base_url}{CHAT}", bodies, schedule, start, start + 300))
    return ttft_summary(answers)


def engine_running(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=30).text
    return series_total(text, "vllm:num_requests_running") or 0.0


def step_series(base_url: str) -> dict:
    """The engine's step counters as /metrics has them now ({} before the code that exports them)."""
    text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith(STEP_SERIES):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def batch_beside_live(base_url: str, tickets: Path, bodies: list[dict], every: float) -> dict:
    """The batch created, then the live client from the moment the engine runs the batch's first lines."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        batch = pool.submit(run_batch_through_sdk, base_url, tickets, hammer=False)
        waited = time.monotonic()
        while engine_running(base_url) == 0:
            if batch.done():
                raise RuntimeError(f"the batch ended before the engine was seen running it: {batch.result()}")
            time.sleep(0.02)
        live = live_client(base_url, bodies, every)
        live["started_after_batch_s"] = round(time.monotonic() - waited, 3)
        return {"live": live, "batch": batch.result().summary()}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--meta", default="{}")
    parser.add_argument("--lines", type=int, default=200, help="the batch's tickets")
    parser.add_argument("--max-tokens", type=int, default=64, help="the tickets' max_tokens")
    parser.add_argument("--live", type=int, default=20, help="streamed live requests a phase")
    parser.add_argument("--live-max-tokens", type=int, default=16)
    parser.add_argument("--every", type=float, default=0.25, help="seconds between live requests")
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--engine-flag", action="append", default=[], help="more `vbatch serve` flags")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for `vbatch serve` (VBATCH_*)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    flags = ["--model", args.model, "--served-model-name", SERVED, "--max-model-len", str(args.max_model_len)]
    flags += (["--enforce-eager"] if args.eager else []) + [f for flag in args.engine_flag for f in flag.split()]
    env = {"VBATCH_DRAIN_SECONDS": "10", **dict(pair.split("=", 1) for pair in args.env)}
    server = VbatchServer(args.out / "data", free_port(), flags, args.out / "serve.log", env=env)
    tickets = {"max_tokens": args.max_tokens, **SAMPLING}
    results: dict = {"meta": {**json.loads(args.meta), **{k: str(v) for k, v in vars(args).items() if k != "meta"}}}
    try:
        results["engine_start_s"] = round(server.wait_ready(timeout=900), 1)
        warm_up(server.base_url, args.out, SERVED, {**SAMPLING, "max_tokens": 4})
        warm = online_bodies(SERVED, 4, words=args.prompt_words, max_tokens=4, sampling=SAMPLING, seed=1)
        live_client(server.base_url, warm, 0.0)
        alone = args.out / "alone.jsonl"
        write_ticket_batch(alone, args.lines, model=SERVED, sampling=tickets, first=1_000_000)
        for run in range(args.runs):
            seed = 100 + run
            bodies = online_bodies(SERVED, args.live, words=args.prompt_words, max_tokens=args.live_max_tokens,
                                   sampling=SAMPLING, seed=seed)  # fmt: skip
            idle = live_client(server.base_url, bodies, args.every)
            if run == 0:
                results["batch_alone"] = run_batch_through_sdk(server.base_url, alone, hammer=False).summary()
                results["steps_after_batch_alone"] = step_series(server.base_url)
            beside_file = args.out / f"beside-{run}.jsonl"
            write_ticket_batch(beside_file, args.lines, model=SERVED, sampling=tickets, first=2_000_000 + run * 10_000)
            bodies = online_bodies(SERVED, args.live, words=args.prompt_words, max_tokens=args.live_max_tokens,
                                   sampling=SAMPLING, seed=seed + 1000)  # fmt: skip
            beside = batch_beside_live(server.base_url, beside_file, bodies, args.every)
            beside["steps_after"] = step_series(server.base_url)
            results[f"run{run}"] = {"idle": idle, "beside": beside}
            i, b = idle["ttft_p90_ms"], beside["live"]["ttft_p90_ms"]
            print(f"run {run}: live TTFT p90 idle {i} ms, beside a starting batch {b} ms "
                  f"({(b or 0) / (i or 1):.1f}x); batch {beside['batch']['generating_s']} s beside, "
                  f"{results['batch_alone']['generating_s']} s alone", flush=True)  # fmt: skip
    finally:
        server.stop()
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
