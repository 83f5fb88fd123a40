from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi.testclient import TestClient

from app.core import failpoints
from app.core.config import Settings
from app.core.storage import Storage
from app.core.stores import open_storage
from app.engine.inference.serving import EngineFactory
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FAKE_MODEL as MODEL
from app.testing import FakeEngine

FINAL = frozenset({"completed", "failed", "cancelled", "expired"})


def storage_of(settings: Settings) -> Storage:
    """The service's storage as its settings name it: the data directory's files, or the S3 store."""
    return open_storage(settings.storage_url, settings.files_dir)


def stored_names(settings: Settings) -> list[str]:
    """Everything the service keeps: in the files directory, or in the S3 store and its scratch directory."""
    return sorted(storage_of(settings).names())


def request_line(custom_id: str, *, url: str = "/v1/chat/completions", **body_fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {custom_id}"}], **body_fields}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return b"".join((json.dumps(x) if not isinstance(x, bytes) else x.decode()).encode() + b"\n" for x in lines)


def upload(client: TestClient, content: bytes, *, purpose: str = "batch", filename: str = "in.jsonl") -> dict:
    response = client.post("/v1/files", files={"file": (filename, content)}, data={"purpose": purpose})
    assert response.status_code == 200, response.text
    return response.json()


def create_batch(client: TestClient, file_id: str, **extra) -> dict:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    response = client.post("/v1/batches", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(predicate: Callable[[], dict | None], timeout: float = 20.0) -> dict:
    """Polls (as a client would) until predicate returns a value; fails the test after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def wait_status(client: TestClient, batch_id: str, statuses: Collection[str], timeout: float = 20.0) -> dict:
    def reached() -> dict | None:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        return batch if batch["status"] in statuses else None

    return wait_for(reached, timeout)


def read_jsonl(client: TestClient, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200
    return [json.loads(line) for line in response.content.splitlines()]


@contextmanager
def serving(app, port: int, **options) -> Iterator[int]:
    """A real uvicorn server for `app` on loopback, on a thread of its own, until the block ends."""
    server = uvicorn.Server(
        uvicorn.Config(app, **{"host": "127.0.0.1", "log_level": "warning", **options, "port": port})
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started)
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def pid_of(holder: str) -> int:
    """The process of a lease holder's name (`app.domain.leases.holder_name`: host/pid/start/tag)."""
    return int(holder.split("/")[1])


@contextmanager
def holding(data_dir: Path) -> Iterator[None]:
    """A server started with `hold_after:N` sends at most N lines of a batch while this lasts."""
    hold = data_dir / failpoints.HOLD_FILE
    hold.touch()
    try:
        yield
    finally:
        hold.unlink(missing_ok=True)


@contextmanager
def app_on(settings: Settings, engine: EngineFactory | None = None) -> Iterator[TestClient]:
    """The app started on the database and files `settings` name, over `engine` (a fresh fake one unless given),
    until the block ends. A second block on the same settings is a restart: it finds what the first left."""
    with TestClient(create_app(settings, EngineService(engine or FakeEngine()))) as client:
        yield client


@dataclass
class HeldBatch:
    """A batch whose engine answered its first lines and holds the others in flight (`engine.executor.gate` lets
    them go); `source` is its input file object, `batch` the batch object as created."""

    client: TestClient
    engine: FakeEngine
    source: dict
    batch: dict


@contextmanager
def held_batch(settings: Settings, *, lines: int, answered: int, **create) -> Iterator[HeldBatch]:
    """A new batch of `lines` requests r0, r1, ... on an app over a fake engine that answers the first `answered`
    and holds the rest. The block starts once those are checkpointed; at its end the app stops mid-batch."""
    engine = FakeEngine()
    engine.executor.answer_first = answered
    with app_on(settings, engine) as client:
        source = upload(client, jsonl([request_line(f"r{i}") for i in range(lines)]))
        batch = create_batch(client, source["id"], **create)
        wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == answered)
        yield HeldBatch(client, engine, source, batch)


def stopped_mid_batch(settings: Settings, *, lines: int, answered: int, **create) -> HeldBatch:
    """`held_batch` with its app already stopped: what a restart on the same settings resumes."""
    with held_batch(settings, lines=lines, answered=answered, **create) as held:
        return held
