"""What estimates cost everyone else (issue 37): while `--estimates` keys each ask for the estimate of one
`--lines`-line file at once, how long `/health` and another key's one-token chat take, against the same with
nothing else running. vbatch runs at most VBATCH_MAX_ESTIMATES estimates at once (2) and one a key; `--bound N`
sets that bound for the server (a bound as large as `--estimates` is what vbatch did before it had one).

  .venv/bin/python -m bench.estimate_load --model data/models/SmolLM2-135M-Instruct --out bench/out-estimate-load \\
      --results bench/results/cpu-estimate-load.json --bound 2 --bound 10

Each bound gets a fresh `vbatch serve` (CPU: `--enforce-eager`); a side samples /health every 0.1 s and the chat
every 0.5 s from a thread each.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.common import VbatchServer, write_ticket_batch
from bench.compare import SAMPLING, SERVED

KEYS = [f"sk-bench-{n:02d}" for n in range(16)]
CHAT = "/v1/chat/completions"


def percentiles(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    if not ordered:
        return {"n": 0}
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000, 1),
            "p99_ms": round(at(0.99) * 1000, 1), "max_ms": round(ordered[-1] * 1000, 1)}  # fmt: skip


class Sampler:
    """/health and a one-token chat of the last key, timed over and over until `stop`."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.health: list[float] = []
        self.chat: list[float] = []
        self.threads = [threading.Thread(target=self._health), threading.Thread(target=self._chat)]

    def __enter__(self) -> Sampler:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _health(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while not self.stop.wait(0.1):
                self.health.append(_timed(lambda: client.get("/health")))

    def _chat(self) -> None:
        body = {"model": SERVED, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 1}
        headers = {"Authorization": f"Bearer {KEYS[-1]}"}
        with httpx.Client(base_url=f"{self.base_url}/v1", timeout=120, headers=headers) as client:
            while not self.stop.wait(0.5):
                self.chat.append(_timed(lambda: client.post("/chat/completions", json=body)))

    def numbers(self) -> dict:
        return {"health": percentiles(self.health), "chat": percentiles(self.chat)}


def _timed(call) -> float:
    started = time.perf_counter()
    call().raise_for_status()
    return time.perf_counter() - started


def estimates(base_url: str, file_ids: list[str]) -> dict:
    """Every key asks for its file's estimate at once: how each ended, and how long those that ran took."""

    def one(key_and_file: tuple[str, str]) -> tuple[int, float]:
        key, file_id = key_and_file
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        started = time.perf_counter()
        answer = httpx.post(f"{base_url}/v1/batches/estimate", json=body, timeout=1800,
                            headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        return answer.status_code, time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(len(file_ids)) as pool:
        done = list(pool.map(one, zip(KEYS, file_ids, strict=False)))
    ran = [seconds for status, seconds in done if status == 200]
    return {"asked": len(done), "answered": len(ran), "refused_429": sum(status == 429 for status, _ in done),
            "seconds": [round(s, 1) for s in ran]}  # fmt: skip


def upload(base_url: str, path: Path, key: str) -> str:
    with path.open("rb") as content:
        answer = httpx.post(f"{base_url}/v1/files", files={"file": content}, data={"purpose": "batch"},
                            headers={"Authorization": f"Bearer {key}"}, timeout=600)  # fmt: skip
    answer.raise_for_status()
    return answer.json()["id"]


def side(args: argparse.Namespace, bound: int, batch: Path) -> dict:
    env = {"VBATCH_API_KEYS": ",".join(KEYS), "VBATCH_MAX_ESTIMATES": str(bound),
           "VBATCH_MAX_ESTIMATES_PER_KEY": str(bound)}  # fmt: skip
    flags = ["--model", args.model, "--served-model-name", SERVED, "--enforce-eager", "--max-model-len", "2048"]
    data = args.out / f"bound-{bound}"
    server = VbatchServer(data, 8135, flags, args.out / f"serve-{bound}.log", env=env)
    try:
        server.wait_ready(timeout=900)
        file_ids = [upload(server.base_url, batch, key) for key in KEYS[: args.estimates]]
        with Sampler(server.base_url) as idle:
            time.sleep(args.idle_seconds)
        with Sampler(server.base_url) as busy:
            asked = estimates(server.base_url, file_ids)
        return {"bound": bound, "idle": idle.numbers(), "during_estimates": busy.numbers(), "estimates": asked}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--estimates", type=int, default=10, help="keys asking at once")
    parser.add_argument("--bound", type=int, action="append", help="VBATCH_MAX_ESTIMATES of a side (repeatable)")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--meta", default="{}")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    batch = args.out / "big.jsonl"
    write_ticket_batch(batch, args.lines, model=SERVED, sampling={**SAMPLING, "max_tokens": 64})
    sides = [side(args, bound, batch) for bound in args.bound or [2]]
    results = {"meta": {**json.loads(args.meta), "lines": args.lines, "estimates": args.estimates}, "sides": sides}
    args.results.write_text(json.dumps(results, indent=2))
    for found in sides:
        print(f"bound {found['bound']}: {found['estimates']['answered']} ran, {found['estimates']['refused_429']} "
              f"refused; /health idle {found['idle']['health']}, during {found['during_estimates']['health']}; "
              f"chat idle {found['idle']['chat']}, during {found['during_estimates']['chat']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
