"""Webhooks as OpenAI sends them, received by a real receiver (uvicorn on loopback) and verified by the openai
SDK's own `webhooks.unwrap`."""

from __future__ import annotations

import base64
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from sqlalchemy import create_engine, text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.testing import VbatchServer, free_port
from tests.helpers import FINAL, app_on, create_batch, jsonl, request_line, serving, upload, wait_for, wait_status
from tests.integration.test_metrics import scrape

pytestmark = pytest.mark.both_backends

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


@dataclass
class Receiver:
    """Records every delivery; answers with `statuses` in turn, then 200."""

    url: str = ""
    statuses: list[int] = field(default_factory=list)
    received: list[tuple[bytes, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def hook(self, request: Request) -> Response:
        body = await request.body()
        with self.lock:
            self.received.append((body, dict(request.headers)))
            status = self.statuses.pop(0) if self.statuses else 200
        return Response(status_code=status)

    def events(self) -> list:
        sdk = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
        with self.lock:
            return [sdk.webhooks.unwrap(body, headers, secret=SECRET) for body, headers in self.received]


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver listening on loopback at `url` until the block ends."""
    recorder = Receiver()
    app = Starlette(routes=[Route("/hook", recorder.hook, methods=["POST"])])
    with serving(app, free_port()) as port:
        recorder.url = f"http://127.0.0.1:{port}/hook"
        yield recorder


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as recorder:
        yield recorder


def with_webhook(settings, url: str, *, allow_private: bool = True):
    settings.webhook_url, settings.webhook_secret = url, SECRET
    settings.webhook_allow_private = allow_private
    settings.webhook_retry_base_seconds = settings.webhook_poll_seconds = 0.05
    return settings


def outbox(settings) -> list:
    engine = create_engine(settings.database)
    try:
        with engine.connect() as connection:
            return list(connection.execute(text("SELECT * FROM webhook_events")).mappings())
    finally:
        engine.dispose()


def test_every_final_state_sends_its_event_and_the_sdk_verifies_it(settings, fake_engine, receiver):
    with app_on(with_webhook(settings, receiver.url), fake_engine) as client:
        completed = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
        wait_status(client, completed["id"], FINAL)
        failed = create_batch(client, upload(client, jsonl([request_line("b", model="no-such-model")]))["id"])
        wait_status(client, failed["id"], FINAL)
        fake_engine.executor.answer_first = fake_engine.executor.calls  # from now on every line waits
        expired = create_batch(client, upload(client, jsonl([request_line("c")]))["id"], completion_window="2s")
        cancelled = create_batch(client, upload(client, jsonl([request_line("d")]))["id"])
        client.post(f"/v1/batches/{cancelled['id']}/cancel")
        for batch in (expired, cancelled):
            wait_status(client, batch["id"], FINAL)
        wait_for(lambda: len(receiver.received) == 4)
        # The receiver answers before the sender records the delivery: wait for the record, not the request.
        wait_for(lambda: all(row["delivered_at"] is not None for row in outbox(settings)))
    kinds = {event.data.id: event.type for event in receiver.events()}
    assert kinds == {
        completed["id"]: "batch.completed",
        failed["id"]: "batch.failed",
        expired["id"]: "batch.expired",
        cancelled["id"]: "batch.cancelled",
    }
    body, headers = receiver.received[0]
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused").webhooks.unwrap(body.replace(b"batch_", b"batch_x"), headers, secret=SECRET)
    assert [row["delivered_at"] is not None for row in outbox(settings)] == [True] * 4


def test_a_receiver_that_fails_gets_the_event_again_until_it_takes_it_then_never_again(settings, fake_engine, receiver):
    receiver.statuses = [500, 500, 500]
    with app_on(with_webhook(settings, receiver.url), fake_engine) as client:
        batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
        wait_status(client, batch["id"], FINAL)
        wait_for(lambda: [row["delivered_at"] for row in outbox(settings)] != [None])
        metrics = scrape(client)
    assert metrics[("vbatch_webhook_deliveries_total", (("outcome", "failed"),))] == 3
    assert metrics[("vbatch_webhook_deliveries_total", (("outcome", "delivered"),))] == 1
    [row] = outbox(settings)
    assert row["attempts"] == 4 and row["last_error"] is None
    assert len(receiver.received) == 4
    assert len({headers["webhook-id"] for _, headers in receiver.received}) == 1  # one event, sent four times
    assert [event.data.id for event in receiver.events()] == [batch["id"]] * 4


def test_a_receiver_on_a_private_address_is_refused_unless_the_operator_allows_it(settings, fake_engine, receiver):
    with app_on(with_webhook(settings, receiver.url, allow_private=False), fake_engine) as client:
        batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
        wait_status(client, batch["id"], FINAL)
        wait_for(lambda: [row["given_up_at"] for row in outbox(settings)] != [None])
    [row] = outbox(settings)
    assert row["delivered_at"] is None and "127.0.0.1" in row["last_error"]
    assert receiver.received == []


def test_an_event_of_a_batch_that_ended_before_a_kill_is_delivered_after_the_restart(tmp_path: Path):
    port = free_port()  # where the receiver will listen: nothing does yet
    hook = f"http://127.0.0.1:{port}/hook"
    env = {
        "VBATCH_WEBHOOK_URL": hook,
        "VBATCH_WEBHOOK_SECRET": SECRET,
        "VBATCH_WEBHOOK_ALLOW_PRIVATE": "true",
        "VBATCH_WEBHOOK_RETRY_BASE_SECONDS": "0.05",
        "VBATCH_WEBHOOK_POLL_SECONDS": "0.05",
        "VBATCH_DISK_RESERVE_BYTES": "0",
    }
    data_dir = tmp_path / "data"
    first = VbatchServer(data_dir, free_port(), [], tmp_path / "first.log", env=env, fake_engine=True)
    try:
        first.wait_ready(60)
        sdk = openai.OpenAI(api_key="unused", base_url=f"{first.base_url}/v1")
        source = sdk.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        batch = sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: sdk.batches.retrieve(batch.id).status == "completed")
        database = data_dir / "vbatch.db"
        wait_for(lambda: sqlite3.connect(database).execute("SELECT max(attempts) FROM webhook_events").fetchone()[0])
        first.kill()
    finally:
        first.stop()
    recorder = Receiver()
    app = Starlette(routes=[Route("/hook", recorder.hook, methods=["POST"])])
    with serving(app, port):
        second = VbatchServer(data_dir, free_port(), [], tmp_path / "second.log", env=env, fake_engine=True)
        try:
            second.wait_ready(60)
            wait_for(lambda: recorder.received)
        finally:
            second.stop()
    assert [(event.type, event.data.id) for event in recorder.events()] == [("batch.completed", batch.id)]


def test_a_key_with_its_own_endpoint_gets_its_events_there_and_other_keys_events_go_nowhere(
    settings, fake_engine, receiver, tmp_path
):
    keys = tmp_path / "keys"
    keys.write_text(f"# alice has her own endpoint\nsk-alice {receiver.url} {SECRET}\nsk-bob\n")
    settings.api_keys_file = keys
    settings.webhook_allow_private = True
    settings.webhook_retry_base_seconds = settings.webhook_poll_seconds = 0.05
    ended = {}
    with app_on(settings, fake_engine) as client:
        for key in ("sk-alice", "sk-bob"):
            client.headers["authorization"] = f"Bearer {key}"
            batch = create_batch(client, upload(client, jsonl([request_line(key)]))["id"])
            ended[key] = wait_status(client, batch["id"], FINAL)
        wait_for(lambda: all(row["attempts"] for row in outbox(settings)))
    assert [event.data.id for event in receiver.events()] == [ended["sk-alice"]["id"]]
    bob = next(row for row in outbox(settings) if row["batch_id"] == ended["sk-bob"]["id"])
    assert bob["delivered_at"] is None and bob["last_error"] == "no webhook endpoint for this key"
