"""`vbatch api` replicas and `vbatch worker` processes over one database and one files directory (fake engines in
processes of their own): batches are shared out, each line answered once, a killed worker's batch is taken over, a
stalled one writes nothing when it comes back, and a cancel reaches whichever worker runs the batch. One fleet on each
backend serves the module's tests in turn (five processes each; a fleet a test made 40 process starts), the test that
kills a worker last."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from app.core.config import Settings
from app.core.db import make_engine
from app.domain import batches
from app.testing import VbatchServer, free_port
from tests.conftest import BOTH_BACKENDS
from tests.helpers import app_on, create_batch, jsonl, pid_of, read_jsonl, request_line, upload, wait_for

LEASE_SECONDS = 3
SHARD_LINES = 500  # the 1,200-line batch below runs as three shards, the 3,000-line ones as six, the others whole


class Cluster:
    """With an S3 store each process has a data directory of its own (scratch), as on machines of their own;
    without, they share one (the files)."""

    def __init__(self, base: Path, database_url: str | None, storage_url: str | None) -> None:
        self.data_dir = base / "data"
        self.base = base
        self.storage_url = storage_url
        self.env = {
            "VBATCH_LEASE_SECONDS": str(LEASE_SECONDS),
            "VBATCH_CHECKPOINT_SECONDS": "0.1",
            # On S3 a batch's counts move on as it ships a segment: within the ~1 s a 400-line batch runs, or a kill
            # "mid-batch" would come after its end.
            "VBATCH_SEGMENT_SECONDS": "0.2",
            "VBATCH_FAKE_SECONDS_PER_ANSWER": "0.02",
            "VBATCH_COMPLETION_WINDOWS": "24h,3s",
            "VBATCH_SHARD_LINES": str(SHARD_LINES),
            **({"VBATCH_DATABASE_URL": database_url} if database_url else {}),
            **({"VBATCH_STORAGE_URL": storage_url} if storage_url else {}),
        }
        self.settings = Settings(data_dir=self.data_dir, database_url=database_url)
        self.workers: list[VbatchServer] = []
        self.apis: list[VbatchServer] = []

    def start(self, role: str) -> VbatchServer:
        name = f"{role}{len(self.workers) + len(self.apis)}"
        data_dir = self.base / name / "data" if self.storage_url else self.data_dir
        server = VbatchServer(
            data_dir, free_port(), [], self.base / f"{name}.log", env=self.env, fake_engine=True, role=role
        )
        (self.workers if role == "worker" else self.apis).append(server)
        return server

    def holder_process(self, batch_id: str) -> VbatchServer:
        """The worker whose lease the batch is on (the holder's name carries its pid)."""
        db = make_engine(self.settings.database)
        try:
            holder = batches.get(db=db, batch_id=batch_id, owner=None).lease_holder
        finally:
            db.dispose()
        assert holder is not None
        [worker] = [worker for worker in self.workers if worker.process.pid == pid_of(holder)]
        return worker

    def row(self, batch_id: str) -> dict:
        db = make_engine(self.settings.database)
        try:
            return batches.get(db=db, batch_id=batch_id, owner=None).model_dump()
        finally:
            db.dispose()

    def log_marks(self) -> dict[Path, int]:
        """Where each worker's log ends now: what `logs_since` reads from (the fleet serves the module's tests)."""
        return {worker.log_path: worker.log_path.stat().st_size for worker in self.workers}

    def logs_since(self, marks: dict[Path, int]) -> list[str]:
        return [path.read_bytes()[start:].decode(errors="replace") for path, start in marks.items()]

    def stop(self) -> None:
        for server in [*self.apis, *self.workers]:
            server.stop()


@pytest.fixture(scope="module", params=BOTH_BACKENDS)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    on_s3 = request.param == "postgres_s3"
    database_url = request.getfixturevalue("postgres").new_database(migrated=True) if on_s3 else None
    storage_url = request.getfixturevalue("s3").new_url() if on_s3 else None
    running = Cluster(tmp_path_factory.mktemp(f"fleet-{request.param}"), database_url, storage_url)
    try:
        running.start("worker").wait_ready(timeout=120)  # the first migrates a SQLite database; the rest find it done
        for server in [running.start("worker"), running.start("worker"), running.start("api"), running.start("api")]:
            server.wait_ready(timeout=120)
        yield running
    finally:
        running.stop()


def sdk(server: VbatchServer) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def submit(client: OpenAI, tmp_path: Path, name: str, lines: int, window: str = "24h") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(jsonl([request_line(f"{name}-{i}") for i in range(lines)]))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window=window,  # type: ignore[arg-type]
    )
    return created.id


def ended(client: OpenAI, batch_id: str, timeout: float = 60):
    return wait_for(
        lambda: (
            (batch := client.batches.retrieve(batch_id)).status in ("completed", "failed", "cancelled", "expired")
            and batch
        ),
        timeout=timeout,
    )


def answers(client: OpenAI, file_id: str | None) -> dict[str, dict]:
    lines = [json.loads(line) for line in client.files.content(file_id).content.splitlines()] if file_id else []
    assert len({line["custom_id"] for line in lines}) == len(lines), "a custom_id answered twice"
    return {line["custom_id"]: line["response"]["body"] for line in lines}


def single_process_answers(tmp_path: Path, name: str, lines: int) -> dict[str, dict]:
    settings = Settings(data_dir=tmp_path / "alone", checkpoint_seconds=0.1, disk_reserve_bytes=65536)
    with app_on(settings) as client:
        source = upload(client, jsonl([request_line(f"{name}-{i}") for i in range(lines)]))
        batch_id = create_batch(client, source["id"])["id"]
        output = wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["output_file_id"])
        rows = read_jsonl(client, output)
    return {row["custom_id"]: row["response"]["body"] for row in rows}


def test_replicas_and_workers_share_batches_and_answer_each_line_once(cluster, tmp_path):
    clients = [sdk(api) for api in cluster.apis]
    ids = [submit(clients[n % 2], tmp_path, f"b{n}", 40) for n in range(10)]
    holders = set()
    for n, batch_id in enumerate(ids):
        batch = ended(clients[(n + 1) % 2], batch_id)  # followed through the other replica
        assert batch.status == "completed" and batch.request_counts.completed == 40
        assert answers(clients[n % 2], batch.output_file_id) == single_process_answers(tmp_path / f"b{n}", f"b{n}", 40)
        holders.add(cluster.row(batch_id)["lease_holder"])
    assert len(holders) >= 2  # the batches were shared out


def test_workers_share_one_large_batch_in_shards_and_a_cancel_reaches_them_all(cluster, tmp_path):
    client = sdk(cluster.apis[0])
    listed_before = {b.id for b in client.batches.list(limit=100)}
    files_before = {f.id for f in client.files.list()}
    marks = cluster.log_marks()
    large = submit(client, tmp_path, "large", 1200)
    batch = ended(client, large)
    assert batch.status == "completed" and batch.request_counts.completed == 1200
    assert answers(client, batch.output_file_id) == single_process_answers(tmp_path / "large", "large", 1200)
    # Its shards, their inputs and their results list nowhere, and are gone.
    assert {b.id for b in client.batches.list(limit=100)} - listed_before == {large}
    assert {f.id for f in client.files.list()} - files_before == {batch.input_file_id, batch.output_file_id}
    logs = cluster.logs_since(marks)
    assert len([log for log in logs if "1200 requests in 3 shards" in log]) == 1
    shard_ends = ("completed, 500 completed", "completed, 200 completed")
    assert len([log for log in logs if any(end in log for end in shard_ends)]) >= 2  # shards ran on two workers

    cancelled = submit(client, tmp_path, "cancelled", 3000)
    wait_for(lambda: client.batches.retrieve(cancelled).request_counts.completed >= 50)
    # Through the other replica: the lines its shards have checkpointed so far, each once.
    partial = httpx.get(f"{cluster.apis[1].base_url}/v1/batches/{cancelled}/partial_output", timeout=30)
    seen = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, partial.content.splitlines())}
    assert len(seen) >= 50 and len(seen) == len(partial.content.splitlines())
    client.batches.cancel(cancelled)
    batch = ended(client, cancelled)
    assert batch.status == "cancelled"
    finished = answers(client, batch.output_file_id)
    assert {custom_id: finished[custom_id] for custom_id in seen} == seen  # kept as first seen
    done = {**finished, **answers_or_errors(client, batch.error_file_id)}
    assert done.keys() == {f"cancelled-{i}" for i in range(3000)}  # every line once: a result or its cancel error
    assert batch.request_counts.completed + batch.request_counts.failed == 3000


def answers_or_errors(client: OpenAI, file_id: str | None) -> dict[str, dict]:
    lines = [json.loads(line) for line in client.files.content(file_id).content.splitlines()] if file_id else []
    assert len({line["custom_id"] for line in lines}) == len(lines), "a custom_id answered twice"
    return {line["custom_id"]: line["error"] for line in lines}


def test_cancel_and_expiry_reach_the_worker_running_the_batch(cluster, tmp_path):
    first, second = (sdk(api) for api in cluster.apis)
    # 3,000 answers at 0.02 s, 8 at a time, take 7.5 s: the 3 s window closes mid-run, on whichever worker runs it.
    expiring = submit(first, tmp_path, "expiring", 3000, window="3s")
    batch = ended(second, expiring)
    assert batch.status == "expired"
    counts = batch.request_counts
    assert 0 < counts.completed < 3000 and counts.completed + counts.failed == 3000

    batch_id = submit(first, tmp_path, "cancelled", 400)
    wait_for(lambda: first.batches.retrieve(batch_id).request_counts.completed >= 20)
    # A replica shows the live numbers the worker kept at its last checkpoint.
    progress = f"{cluster.apis[1].base_url}/v1/batches/{batch_id}/progress"
    assert wait_for(lambda: httpx.get(progress).json()["requests_per_second"]) > 0
    second.batches.cancel(batch_id)
    batch = ended(first, batch_id)
    assert batch.status == "cancelled"
    counts = batch.request_counts
    assert counts.total == 400 and 20 <= counts.completed < 400 and counts.completed + counts.failed == 400


def test_a_killed_workers_batch_is_taken_over_and_a_stalled_one_writes_nothing(cluster, tmp_path):
    # The module's last on its fleet: it leaves one worker dead.
    client = sdk(cluster.apis[0])
    killed_batch = submit(client, tmp_path, "killed", 400)
    wait_for(lambda: client.batches.retrieve(killed_batch).request_counts.completed >= 40)
    killed = cluster.holder_process(killed_batch)
    killed.kill()
    batch = ended(client, killed_batch)
    assert batch.status == "completed"
    assert answers(client, batch.output_file_id).keys() == {f"killed-{i}" for i in range(400)}
    assert cluster.row(killed_batch)["lease_token"] == 2  # one takeover

    stalled_batch = submit(client, tmp_path, "stalled", 400)
    wait_for(lambda: client.batches.retrieve(stalled_batch).request_counts.completed >= 40)
    stalled = cluster.holder_process(stalled_batch)
    os.killpg(stalled.process.pid, signal.SIGSTOP)
    try:
        batch = ended(client, stalled_batch)
        published = client.files.content(batch.output_file_id).content
        # The worker that finished it ends its lease once its run files are gone: nothing writes the row after that.
        row = wait_for(lambda: (found := cluster.row(stalled_batch))["lease_expires_ns"] is None and found)
    finally:
        os.killpg(stalled.process.pid, signal.SIGCONT)
    wait_for(lambda: "its lease passed to another service" in stalled.log_path.read_text())
    assert cluster.row(stalled_batch) == row
    assert client.files.content(batch.output_file_id).content == published
    assert answers(client, batch.output_file_id).keys() == {f"stalled-{i}" for i in range(400)}
