"""A bounded load test on loopback: `vbatch serve`'s app and server in a process of its own (fake engine), under 50
concurrent 5 MB uploads, 20 clients that create, poll, download and delete, and about 600 deletes while 60 batches
checkpoint every 50 ms (where "database is locked" used to answer 500). No 5xx, no object lost; the server's RSS is
printed (`pytest -s`) for the record, not asserted: memory targets are the benchmarks'."""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from app.testing import VbatchServer, free_port
from tests.helpers import FINAL, jsonl, request_line

UPLOADS = 50
UPLOAD_BYTES = 5 * 1024 * 1024
CLIENTS = 20
BATCHES_PER_CLIENT = 3
LINES_PER_BATCH = 10
DELETES_PER_CLIENT = 30


class Record:
    """Every response's status, from every thread."""

    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()
        self.server_errors: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, response: httpx.Response) -> httpx.Response:
        with self.lock:
            self.statuses[response.status_code] += 1
            if response.status_code >= 500:
                self.server_errors.append(f"{response.request.method} {response.request.url.path}: {response.text}")
        return response


def big_file(seed: int) -> bytes:
    """UPLOAD_BYTES of batch lines of about 500 bytes each."""
    lines, size = [], 0
    while size < UPLOAD_BYTES:
        line = json.dumps(request_line(f"u{seed}-{len(lines)}", user="x" * 400)).encode() + b"\n"
        lines.append(line)
        size += len(line)
    return b"".join(lines)


def upload(http: httpx.Client, record: Record, content: bytes) -> str:
    response = record(http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}))
    assert response.status_code == 200, response.text
    return response.json()["id"]


def uploader(base_url: str, record: Record, seed: int) -> tuple[str, int]:
    content = big_file(seed)
    with httpx.Client(base_url=base_url, timeout=120) as http:
        return upload(http, record, content), len(content)


def batch_client(base_url: str, record: Record, seed: int) -> list[dict]:
    ended = []
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for b in range(BATCHES_PER_CLIENT):
            lines = [request_line(f"c{seed}-{b}-{i}") for i in range(LINES_PER_BATCH)]
            source = upload(http, record, jsonl(lines))
            body = {"input_file_id": source, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            created = record(http.post("/v1/batches", json=body))
            assert created.status_code == 200, created.text
            batch = created.json()
            throwaways = 0
            while batch["status"] not in FINAL:
                if throwaways < DELETES_PER_CLIENT // BATCHES_PER_CLIENT:  # deletes while batches checkpoint
                    throwaway = upload(http, record, jsonl([request_line("t")]))
                    deleted = record(http.delete(f"/v1/files/{throwaway}"))
                    assert deleted.status_code == 200 and deleted.json()["deleted"], deleted.text
                    throwaways += 1
                batch = record(http.get(f"/v1/batches/{batch['id']}")).json()
            for _ in range(throwaways, DELETES_PER_CLIENT // BATCHES_PER_CLIENT):
                throwaway = upload(http, record, jsonl([request_line("t")]))
                assert record(http.delete(f"/v1/files/{throwaway}")).status_code == 200
            output = record(http.get(f"/v1/files/{batch['output_file_id']}/content"))
            assert output.status_code == 200
            batch["output_ids"] = sorted(json.loads(line)["custom_id"] for line in output.content.splitlines())
            batch["expected_ids"] = sorted(line["custom_id"] for line in lines)
            assert record(http.delete(f"/v1/files/{source}")).status_code == 200
            ended.append(batch)
    return ended


def sample_rss(pid: int, stop: threading.Event, samples: list[int]) -> None:
    process = psutil.Process(pid)
    while not stop.wait(0.1):
        samples.append(process.memory_info().rss)


def test_under_load_no_request_fails_and_nothing_is_lost(tmp_path: Path):
    server = VbatchServer(
        tmp_path / "data",
        free_port(),
        [],
        tmp_path / "server.log",
        env={"VBATCH_CHECKPOINT_SECONDS": "0.05", "VBATCH_DISK_RESERVE_BYTES": "0"},
        fake_engine=True,
    )
    record, stop, rss = Record(), threading.Event(), []
    try:
        server.wait_ready(60)
        sampler = threading.Thread(target=sample_rss, args=(server.process.pid, stop, rss), daemon=True)
        sampler.start()
        with ThreadPoolExecutor(UPLOADS + CLIENTS) as pool:
            uploads = [pool.submit(uploader, server.base_url, record, seed) for seed in range(UPLOADS)]
            clients = [pool.submit(batch_client, server.base_url, record, seed) for seed in range(CLIENTS)]
            uploaded = [future.result() for future in uploads]
            batches = [batch for future in clients for batch in future.result()]
        stop.set()
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for file_id, size in uploaded:  # every upload is whole and listed
                meta = record(http.get(f"/v1/files/{file_id}")).json()
                assert meta["bytes"] == size
            listed = record(http.get("/v1/files", params={"limit": 10000})).json()["data"]
        print(
            f"\nload: {sum(record.statuses.values())} requests {dict(record.statuses)}; server RSS "
            f"{min(rss) // 2**20}-{max(rss) // 2**20} MB over {len(rss)} samples"
        )
    finally:
        stop.set()
        server.stop()
    assert record.server_errors == []
    assert "database is locked" not in (tmp_path / "server.log").read_text()
    assert len(batches) == CLIENTS * BATCHES_PER_CLIENT
    for batch in batches:
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == LINES_PER_BATCH
        assert batch["output_ids"] == batch["expected_ids"]
    assert {file_id for file_id, _ in uploaded} <= {f["id"] for f in listed}
