"""What keeping tenants apart in the prefix cache costs a batch (issue 37), in one device call: a fresh, warm
`vbatch serve` with one key runs the seed's tickets and the 20,000 labels that share a block of rules, once with the
cache shared across keys (`VBATCH_SHARED_PREFIX_CACHE=true`, what vbatch did before) and once kept apart by tenant
(the default). One key's lines share their prefixes either way, so the goal is no loss over 3%.

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.tenant_cache --model $BENCH_MODEL --out /tmp/t \\
      --results $OUT/tenant-cache.json

On the CPU (a smoke run): `--model data/models/SmolLM2-135M-Instruct --no-dummy --eager --labels 200 --tickets 32
--max-tokens 16 --max-model-len 2048`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

from bench import compare
from bench.common import SideResults, VbatchServer, run_batch_through_sdk, warm_up, write_ticket_batch
from bench.labels import LABEL_BODY, SERVED, label_messages

KEY = "bench"  # the key run_batch_through_sdk sends: one tenant


def rates(server: VbatchServer, path: Path) -> dict:
    """A batch's rates over its turnaround, and the stages the service timed (read with the tenant's key)."""
    run = run_batch_through_sdk(server.base_url, path, hammer=False)
    progress = httpx.get(f"{server.base_url}/v1/batches/{run.batch_id}/progress", timeout=30,
                         headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    return {**run.summary(), "timeline_s": progress.json()["timeline"],
            "requests_per_s": round(run.completed / run.turnaround_s, 1),
            "output_tokens_per_s_turnaround": round(run.output_tokens / run.turnaround_s, 1)}  # fmt: skip


def write_labels(path: Path, count: int) -> Path:
    with path.open("w") as out:
        for n in range(count):
            body = {"model": SERVED, "messages": label_messages(n, shared=True), **LABEL_BODY}
            out.write(json.dumps({"custom_id": f"item-{n}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")  # fmt: skip
    return path


def sides(args: argparse.Namespace, files: dict[str, Path], side, shared: bool) -> None:
    env = {"VBATCH_API_KEYS": KEY, "VBATCH_SHARED_PREFIX_CACHE": str(shared).lower()}
    serve_side(args, files, side, "shared" if shared else "apart", env)


def serve_side(args: argparse.Namespace, files: dict[str, Path], side, name: str, env: dict,
               cwd: Path | None = None) -> None:  # fmt: skip
    """A fresh `vbatch serve` (from `cwd`'s source tree if given), warmed, then each file as a batch."""
    count = ["--api-server-count", str(args.api_server_count)] if args.api_server_count else []
    flags = compare.engine_flags(args) + count
    server = VbatchServer(args.out / f"data-{name}", 8129, flags, args.out / f"serve-{name}.log", env=env, cwd=cwd)
    try:
        if not side(f"{name}_engine_start", lambda: {"s": round(server.wait_ready(timeout=600), 2)}):
            return
        warm_up(server.base_url, args.out, SERVED, compare.SAMPLING)
        for batch, path in files.items():
            side(f"{name}_{batch}", lambda path=path: rates(server, path))
    finally:
        server.stop()


def goals(data: dict) -> list[str]:
    return ratios(data, "apart", "shared")


def ratios(data: dict, new: str, old: str) -> list[str]:
    """Side `new` over side `old` on each file's rate, against the goal of no loss over 3%."""
    lines = []
    for batch, rate in (("tickets", "output_tokens_per_s_turnaround"), ("labels_shared", "requests_per_s")):
        before, after = data.get(f"{old}_{batch}", {}).get(rate), data.get(f"{new}_{batch}", {}).get(rate)
        if before and after:
            ratio = after / before
            lines.append(f"{batch}: {rate} {new} {after} / {old} {before} = {ratio:.3f} (goal >= 0.97): "
                         f"{'met' if ratio >= 0.97 else 'NOT met'}")  # fmt: skip
        else:
            lines.append(f"{batch}: {new} / {old} not measured")
    return lines


def parser() -> argparse.ArgumentParser:
    parser = compare.device_parser()
    parser.add_argument("--labels", type=int, default=20_000)
    parser.add_argument("--tickets", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=compare.SAMPLING["max_tokens"])
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="dummy weights")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (CPU: no compile)")
    return parser


def workload(args: argparse.Namespace) -> tuple[dict[str, Path], SideResults]:
    """The two files every side runs, and the results they go to."""
    args.out.mkdir(parents=True, exist_ok=True)
    files = {
        "tickets": args.out / "tickets.jsonl",
        "labels_shared": write_labels(args.out / "labels.jsonl", args.labels),
    }
    write_ticket_batch(files["tickets"], args.tickets, model=SERVED,
                       sampling={**compare.SAMPLING, "max_tokens": args.max_tokens})  # fmt: skip
    return files, SideResults(args.results, {**json.loads(args.meta), "labels": args.labels, "tickets": args.tickets})


def report(results: SideResults, lines: list[str]) -> None:
    results.data["goals"] = lines
    results.path.write_text(json.dumps(results.data, indent=2))
    print("\n".join(lines), flush=True)


def main() -> None:
    args = parser().parse_args()
    files, results = workload(args)
    for shared in (True, False):
        sides(args, files, results.side, shared)
    report(results, goals(results.data["sides"]))


if __name__ == "__main__":
    main()
