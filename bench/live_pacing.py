"""Live first tokens beside batches (issue 39): every side in one device call, within 600 s.

Sides, in this order, each driven by the same open-loop online client as `bench.online` (Poisson arrivals, ~200-token
prompts of their own, streamed, timed from the server-sent events as they arrive):

  vbatch      one `vbatch serve` (a fresh engine), in phases on the same engine:
                alone            the online client alone;
                tickets          the seed's 20,000 tickets as a batch: a window with no online traffic (its rate
                                 alone), then a window with the online client (then the batch is cancelled);
                labels_alone     20,000 one-token labels, created to completed, nothing else running;
                labels_live      20,000 other labels, created to completed, with the online client running
                                 throughout (it starts a moment before the batch).
  vllm_serve  `vllm serve` (a fresh engine, first come, first served) with the online client and the tickets pushed
              by a batch client (2 x max_num_seqs requests in flight), as `bench.online` does.

The engine's steps are read from /metrics (`vbatch_engine_step_*`, where the code has them) at both ends of each
window: step time and tokens per step (batch prefill, live prefill, decode), so a slow first token has its reason.

GPU (the stage of ../shared/gpu/README.md carried and unpacked first):
  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.live_pacing --model $BENCH_MODEL --out /tmp/lp \\
      --results $OUT/live-pacing.json --meta '{"machine": "...", "commit": "..."}'
The same file runs against an older commit (it reads only the HTTP API and /metrics): copy `bench/` over that
commit's tree for the before side of a before/after pair. `--engine-flag "--max-num-batched-tokens 4096"` runs both
servers with a smaller step budget (the cost of that for a batch alone, in a call of its own).
CPU (tiny, shows the bench works):
  flock /tmp/vbatch-engine.lock .venv/bin/python -m bench.live_pacing --model data/models/SmolLM2-135M-Instruct \\
      --no-dummy --eager --max-model-len 2048 --rate 1 --seconds 10 --alone-seconds 5 --tickets 400 --max-tokens 32 \\
      --labels 300 --online-max-tokens 16 --sides vbatch --deadline 1200 --out /tmp/lp --results /tmp/lp/r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from functools import partial
from pathlib import Path

import httpx

from app.testing import free_port
from bench import compare
from bench.common import SideResults, VbatchServer, warm_up, write_ticket_batch
from bench.labels import write_labels
from bench.online import (
    CHAT,
    SAMPLING,
    SERVED,
    STOP_S,
    VBATCH_ENV,
    BatchPusher,
    Deadline,
    VllmServe,
    Window,
    create_batch,
    engine_flags,
    kept,
    log_shown_on_error,
    measure_window,
    pushed_in,
    raise_open_files,
    reap,
    wait_busy,
    wait_gpu_free,
    warm_online,
    warm_plain,
)
from bench.online_load import AUTH, online_bodies, open_loop, poisson_schedule, raw_rows, series_total, summarize

STEP_KINDS = ("batch_prefill", "live_prefill", "decode")
FIRST_START_S, LATER_START_S = 150, 90


def labelled(text: str, name: str, label: str) -> float:
    """A series' value for one `kind` label (0 where /metrics has none)."""
    prefix = f'{name}{{kind="{label}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def steps_between(before: str, after: str) -> dict | None:
    """The engine's steps between two scrapes: how many, their mean time, and tokens per step by kind; None where
    the code exports no step series (an older commit)."""
    count = (series_total(after, "vbatch_engine_steps_total") or 0) - (
        series_total(before, "vbatch_engine_steps_total") or 0
    )
    if series_total(after, "vbatch_engine_steps_total") is None or count <= 0:
        return None
    seconds = (series_total(after, "vbatch_engine_step_seconds_sum") or 0) - (
        series_total(before, "vbatch_engine_step_seconds_sum") or 0
    )
    tokens = {
        kind: round(
            (
                labelled(after, "vbatch_engine_step_tokens_total", kind)
                - labelled(before, "vbatch_engine_step_tokens_total", kind)
            )
            / count,
            1,
        )
        for kind in STEP_KINDS
    }
    return {"steps": int(count), "step_ms_mean": round(seconds / count * 1000, 2), "tokens_per_step": tokens}


def window_numbers(window: Window, max_tokens: int | None = None) -> dict:
    batch = kept(window, max_tokens) if max_tokens is not None and window.progress else window.batch_rate()
    return {**batch, "engine_steps": steps_between(window.before, window.after)}


def labels_run(base_url: str, path: Path, work: dict | None, tail: float) -> dict:
    """A labels batch created to completed; with `work` (online bodies and schedule), the online client runs from a
    moment before the batch to its end."""
    return asyncio.run(_labels_run(base_url, path, work, tail))


async def _labels_run(base_url: str, path: Path, work: dict | None, tail: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0)
    async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
        before = (await http.get(f"{base_url}/metrics")).text
        uploaded = await client.files.create(file=path.open("rb"), purpose="batch")
        start = time.monotonic()
        online = None
        if work is not None:
            online = asyncio.create_task(
                open_loop(f"{base_url}{CHAT}", work["bodies"], work["schedule"], start, start + work["seconds"] + tail)
            )
        await asyncio.sleep(0.5 if work is not None else 0)  # the online client first: a batch starting beside it
        created = time.monotonic()
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.1)
            batch = await client.batches.retrieve(batch.id)
        ended = time.monotonic()
        after = (await http.get(f"{base_url}/metrics")).text
        answers = list(await online) if online is not None else []
    seconds = ended - created
    result = {
        "status": batch.status,
        "completed": batch.request_counts.completed,
        "seconds": round(seconds, 2),
        "requests_per_s": round(batch.request_counts.completed / seconds, 1),
        "engine_steps": steps_between(before, after),
    }
    if work is not None:
        in_batch = [a for a in answers if created <= a.sent_at <= ended]
        result["online"] = {**summarize(in_batch), "requests": raw_rows(in_batch), "all_sent": len(answers)}
    return result


def online_work(args: argparse.Namespace, seconds: float, seed: int) -> dict:
    schedule = poisson_schedule(args.rate, seconds, seed)
    bodies = online_bodies(SERVED, len(schedule), words=args.prompt_words, max_tokens=args.online_max_tokens,
                           sampling=SAMPLING, seed=seed)  # fmt: skip
    return {"schedule": schedule, "bodies": bodies, "seconds": seconds}


def cancel(base_url: str, batch_id: str) -> None:
    httpx.post(f"{base_url}/v1/batches/{batch_id}/cancel", headers=AUTH, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = httpx.get(f"{base_url}/v1/batches/{batch_id}", headers=AUTH, timeout=30).json()["status"]
        if status in ("cancelled", "completed", "failed", "expired"):
            return
        time.sleep(0.2)


def flags_of(args: argparse.Namespace) -> list[str]:
    return engine_flags(args) + args.extra_flags


def vbatch_side(args: argparse.Namespace, files: dict[str, Path], deadline: Deadline) -> dict:
    flags = flags_of(args) + (["--api-server-count", str(args.api_server_count)] if args.api_server_count else [])
    server = VbatchServer(args.out / "vbatch-data", free_port(), flags, args.out / "vbatch-serve.log", env=VBATCH_ENV)
    out: dict = {}
    try:
        with log_shown_on_error(server.log_path):
            out["engine_start_s"] = round(server.wait_ready(timeout=deadline.engine_start_timeout()), 2)
            warm_up(server.base_url, args.out, SERVED, compare.SAMPLING)
            out["warm_online_errors"] = warm_online(server.base_url, args)
            alone_work = online_work(args, args.seconds, args.seed)
            alone = measure_window(server.base_url, args.seconds, alone_work["bodies"], alone_work["schedule"],
                                   tail=args.tail)  # fmt: skip
            out["alone"] = {"online": alone.online(), "engine_steps": steps_between(alone.before, alone.after)}
            out["tickets"] = tickets_phase(args, server.base_url, files["tickets"], deadline)
            out["labels_alone"] = labels_run(server.base_url, files["labels_alone"], None, args.tail)
            # The online client for about as long as the labels took alone: it ends with the batch, not after.
            labels_work = online_work(args, out["labels_alone"]["seconds"] * 1.2 + 1.0, args.seed + 7)
            out["labels_live"] = labels_run(server.base_url, files["labels_live"], labels_work, args.tail)
        return out
    finally:
        server.stop()
        reap(server.process.pid)


def tickets_phase(args: argparse.Namespace, base_url: str, tickets: Path, deadline: Deadline) -> dict:
    batch_id = create_batch(base_url, tickets)
    wait_busy(base_url)
    time.sleep(args.ramp)  # from the first lines to a full engine: part of the workload, not a wait
    alone_s, online_s = args.alone_seconds, args.seconds
    progress = f"{base_url}/v1/batches/{batch_id}/progress"
    work = online_work(args, online_s, args.seed + 3)
    alone = measure_window(base_url, alone_s, [], [], tail=0, progress_url=progress)
    mixed = measure_window(base_url, online_s, work["bodies"], work["schedule"], tail=args.tail, progress_url=progress)
    cancel(base_url, batch_id)
    return {"id": batch_id, "online": mixed.online(), "alone": window_numbers(alone, args.max_tokens),
            "with_online": window_numbers(mixed, args.max_tokens)}  # fmt: skip


def vllm_serve_side(args: argparse.Namespace, files: dict[str, Path], deadline: Deadline) -> dict:
    server = VllmServe(flags_of(args), free_port(), args.out / "vllm-serve.log")
    pusher = None
    try:
        with log_shown_on_error(server.log_path):
            start_s = server.wait_ready(timeout=deadline.engine_start_timeout())
            warm_plain(server.base_url, files["tickets"])
            warm_errors = warm_online(server.base_url, args)
            pusher = BatchPusher(f"{server.base_url}{CHAT}", files["tickets"], args.batch_concurrency,
                                 args.out / "pushed.json")  # fmt: skip
            wait_busy(server.base_url)
            time.sleep(args.ramp)
            (seconds,) = deadline.windows([args.seconds], reserve=args.tail + STOP_S)
            work = online_work(args, seconds, args.seed + 3)
            window = measure_window(server.base_url, seconds, work["bodies"], work["schedule"], tail=args.tail)
            finishing, pusher = pusher, None
            pushed = finishing.finish()
        batch = {**window.batch_rate(), **pushed_in(pushed, window), "concurrency": args.batch_concurrency}
        return {"engine_start_s": round(start_s, 2), "warm_online_errors": warm_errors, "online": window.online(),
                "batch": batch}  # fmt: skip
    finally:
        if pusher is not None:
            pusher.finish()
        server.stop()


def p99(side: dict | None) -> float | None:
    return ((side or {}).get("online") or {}).get("ttft_p99_ms")


def goals(sides: dict) -> list[str]:
    """The issue's goals, each with its numbers, or why it could not be judged."""
    v = sides.get("vbatch") or {}
    alone, tickets, labels = p99(v.get("alone")), p99(v.get("tickets")), p99(v.get("labels_live"))
    lines = []
    if alone and tickets:
        ok = "met" if tickets <= 3 * alone and tickets <= 150 else "NOT met"
        lines.append(f"live TTFT p99 beside tickets {tickets} ms / alone {alone} ms = {tickets / alone:.2f}x "
                     f"(goal <= 3x and <= 150 ms): {ok}")  # fmt: skip
    if alone and labels:
        ok = "met" if labels <= 4 * alone else "NOT met"
        lines.append(f"live TTFT p99 beside labels {labels} ms / alone = {labels / alone:.2f}x (goal <= 4x): {ok}")
    t = v.get("tickets") or {}
    a, m = ((t.get(k) or {}).get("output_tokens_per_s") for k in ("alone", "with_online"))
    if a and m is not None:
        ok = "met" if m >= 0.9 * a else "NOT met"
        lines.append(f"tickets output tok/s with live {m} / alone {a} = {m / a:.3f}x (goal >= 0.9x): {ok}")
    la, ll = ((v.get(k) or {}).get("requests_per_s") for k in ("labels_alone", "labels_live"))
    if la and ll is not None:
        ok = "met" if ll >= 0.85 * la else "NOT met"
        lines.append(f"labels requests/s with live {ll} / alone {la} = {ll / la:.3f}x (goal >= 0.85x): {ok}")
    s = p99(sides.get("vllm_serve"))
    if s and tickets:
        lines.append(f"vllm serve (fcfs) + batch client: live TTFT p99 {s} ms (vbatch beside tickets: {tickets} ms)")
    lines.append(f"batch alone, for the before/after pair: tickets {a} output tok/s (window), labels {la} requests/s")
    return lines


def print_table(sides: dict) -> None:
    print(f"\n{'side':<22}{'sent':>6}{'fail':>6}{'TTFT p50':>10}{'p99 ms':>8}{'batch rate':>13}{'step ms':>9}"
          f"{'batch pf':>10}{'live pf':>9}{'decode':>8}")  # fmt: skip
    v = sides.get("vbatch") or {}
    tickets, serve = v.get("tickets") or {}, sides.get("vllm_serve") or {}
    rows = [("alone", v.get("alone"), None), ("tickets, no live", None, tickets.get("alone")),
            ("tickets + live", tickets, tickets.get("with_online")), ("labels alone", None, v.get("labels_alone")),
            ("labels + live", v.get("labels_live"), v.get("labels_live")),
            ("vllm serve + client", serve, serve.get("batch"))]  # fmt: skip
    for name, online_side, batch in rows:
        o = (online_side or {}).get("online") or {}
        rate = (batch or {}).get("output_tokens_per_s") or (batch or {}).get("requests_per_s") or "-"
        steps = ((batch or online_side or {}).get("engine_steps")) or {}
        per = steps.get("tokens_per_step") or {}
        cells = [o.get("sent"), o.get("failed"), o.get("ttft_p50_ms"), o.get("ttft_p99_ms"), rate,
                 steps.get("step_ms_mean"), *(per.get(kind) for kind in STEP_KINDS)]  # fmt: skip
        widths = (6, 6, 10, 8, 13, 9, 10, 9, 8)
        print(f"{name:<22}" + "".join(f"{'-' if c is None else c!s:>{w}}" for c, w in zip(cells, widths, strict=True)))
    for name in ("vbatch", "vllm_serve"):
        if "error" in sides.get(name, {}):
            print(f"{name}: {sides[name]['error'][:200]}")


def arguments() -> argparse.Namespace:
    parser = compare.device_parser()
    parser.add_argument("--sides", default="vbatch,vllm_serve")
    parser.add_argument("--rate", type=float, default=4.0, help="online requests a second (Poisson)")
    parser.add_argument("--seconds", type=float, default=25.0, help="each online window")
    parser.add_argument("--alone-seconds", type=float, default=10.0, help="the tickets batch with no online")
    parser.add_argument("--ramp", type=float, default=4.0, help="from the batch's first lines to its windows")
    parser.add_argument("--tail", type=float, default=10.0, help="how long online requests may run past a window")
    parser.add_argument("--prompt-words", type=int, default=180)
    parser.add_argument("--online-max-tokens", type=int, default=128)
    parser.add_argument("--tickets", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=256, help="the tickets' max_tokens")
    parser.add_argument("--labels", type=int, default=20_000)
    parser.add_argument("--batch-concurrency", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument(
        "--engine-flag", dest="extra", action="append", default=[], help="more engine flags, both sides"
    )
    parser.add_argument("--deadline", type=float, default=575.0)
    args = parser.parse_args()
    args.extra_flags = [flag for group in args.extra for flag in group.split()]
    return args


def main() -> None:
    args = arguments()
    deadline = Deadline(args.deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    raise_open_files()
    files = {"tickets": args.out / "tickets.jsonl"}
    write_ticket_batch(
        files["tickets"], args.tickets, model=SERVED, sampling={**compare.SAMPLING, "max_tokens": args.max_tokens}
    )
    files["labels_alone"] = write_labels(args.out / "labels-alone.jsonl", shared=False, first=0, count=args.labels)
    files["labels_live"] = write_labels(
        args.out / "labels-live.jsonl", shared=False, first=10 * args.labels, count=args.labels
    )
    meta = {**json.loads(args.meta), **{k: str(v) for k, v in vars(args).items() if k != "meta"}}
    results = SideResults(args.results, meta)
    sides = {"vbatch": vbatch_side, "vllm_serve": vllm_serve_side}
    for name in args.sides.split(","):
        wait_gpu_free()
        results.side(name, partial(sides[name], args, files, deadline))
    requests = {}
    for name, side in results.data["sides"].items():
        for phase in ("alone", "tickets", "labels_live") if name == "vbatch" else ("",):
            holder = side.get(phase) if phase else side
            online = (holder or {}).get("online") if isinstance(holder, dict) else None
            if isinstance(online, dict) and "requests" in online:
                requests[f"{name}.{phase}".rstrip(".")] = online.pop("requests")
    results.data["requests"] = requests
    results.data["goals"] = goals(results.data["sides"])
    results.path.write_text(json.dumps(results.data, indent=2))
    print_table(results.data["sides"])
    print("\n".join(results.data["goals"]), flush=True)


if __name__ == "__main__":
    main()
