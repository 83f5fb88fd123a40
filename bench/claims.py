"""Claiming (issue 18): how fast workers take batches from the database, and how soon a dead worker's batch is
taken over.

1. Claims/s: `--batches` active batch rows; `--workers` threads, each a worker's claim loop (`leases.claim`, one
   batch a claim, as a worker with room for one more does), until every batch is held. Each batch must be claimed
   exactly once.
2. Takeover: three `vbatch worker` processes (fake engine, `VBATCH_LEASE_SECONDS` as given) and one `vbatch api`;
   a batch runs, its worker is killed with SIGKILL, and the time from the kill to the batch's next checkpoint
   by another worker is measured (the lease's length plus at most one look for work, a second).

  .venv/bin/python -m bench.claims --out /tmp/claims --results bench/results/cpu-claims.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from app.core.config import Settings
from app.core.db import make_engine
from app.core.migrate import upgrade_to_head
from app.domain import batches, leases
from app.testing import LocalPostgres, VbatchServer, add_running_batches


def claims_per_second(url: str, batches_count: int, workers: int) -> dict:
    upgrade_to_head(url)
    db = make_engine(url)
    add_running_batches(db, batches_count, prefix="batch_bench")
    taken: list[list[str]] = [[] for _ in range(workers)]

    def worker(index: int) -> None:
        while claimed := leases.claim(db=db, holder=f"bench-{index}", seconds=60, limit=1):
            taken[index] += [lease.batch_id for lease in claimed]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    counts = Counter(batch_id for mine in taken for batch_id in mine)
    assert len(counts) == batches_count and set(counts.values()) == {1}, "a batch claimed twice, or never"
    db.dispose()
    return {
        "batches": batches_count,
        "workers": workers,
        "seconds": round(seconds, 3),
        "claims_per_s": round(batches_count / seconds, 1),
        "per_worker": sorted(len(mine) for mine in taken),
    }


def takeover_seconds(out: Path, url: str | None, lease_seconds: float, port: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    data_dir = out / "takeover-data"
    env = {
        "VBATCH_LEASE_SECONDS": str(lease_seconds),
        "VBATCH_CHECKPOINT_SECONDS": "0.1",
        "VBATCH_FAKE_SECONDS_PER_ANSWER": "0.05",
        **({"VBATCH_DATABASE_URL": url} if url else {}),
    }
    servers = []
    try:
        for n in range(3):
            worker = VbatchServer(data_dir, port + n, [], out / f"worker{n}.log", env, fake_engine=True, role="worker")
            servers.append(worker)
            worker.wait_ready(timeout=120)
        api = VbatchServer(data_dir, port + 3, [], out / "api.log", env, fake_engine=True, role="api")
        servers.append(api)
        api.wait_ready(timeout=120)
        http = httpx.Client(base_url=api.base_url, timeout=30)
        lines = "".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"q{i}"}]}}) + "\n"
            for i in range(2000)
        )  # fmt: skip
        file_id = http.post("/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch_id = http.post("/v1/batches", json=body).json()["id"]
        while http.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 100:
            time.sleep(0.05)
        db = make_engine(Settings(data_dir=data_dir, database_url=url).database)
        row = batches.get(db=db, batch_id=batch_id, owner=None)
        pid = int((row.lease_holder or "").split("/")[1])
        [holder] = [server for server in servers if server.process.pid == pid]
        done_at_kill = row.completed
        holder.kill()
        killed = time.perf_counter()
        while True:
            now = batches.get(db=db, batch_id=batch_id, owner=None)
            if now.lease_token >= 2 and now.completed > done_at_kill:
                break
            time.sleep(0.02)
        retaken = time.perf_counter() - killed
        while http.get(f"/v1/batches/{batch_id}").json()["status"] != "completed":
            time.sleep(0.1)
        final = batches.get(db=db, batch_id=batch_id, owner=None)
        db.dispose()
        return {
            "lease_seconds": lease_seconds,
            "kill_to_next_checkpoint_s": round(retaken, 2),
            "completed": final.completed,
            "lease_token": final.lease_token,
        }
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--lease-seconds", type=float, default=5.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict = {"meta": {"commit": commit, "machine": f"{platform.node()}, {len(os.sched_getaffinity(0))} cores"}}
    postgres = LocalPostgres(args.out / "pg")
    try:
        for name, url in (("sqlite", f"sqlite:///{args.out / 'claims.db'}"), ("postgres", postgres.new_database())):
            results[f"claims_{name}"] = claims_per_second(url, args.batches, args.workers)
            print(json.dumps({f"claims_{name}": results[f"claims_{name}"]}), flush=True)
        for name, url in (("sqlite", None), ("postgres", postgres.new_database())):
            results[f"takeover_{name}"] = takeover_seconds(args.out / name, url, args.lease_seconds, 8300)
            print(json.dumps({f"takeover_{name}": results[f"takeover_{name}"]}), flush=True)
    finally:
        postgres.stop()
    args.results.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
