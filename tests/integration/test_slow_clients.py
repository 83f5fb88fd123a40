"""Slow and greedy clients against a real uvicorn server with `vbatch serve`'s own options (fake engine)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from app.core.config import Settings
from app.engine.service import EngineService
from app.launch import server_options
from app.main import create_app
from app.testing import FakeEngine, free_port
from tests.helpers import jsonl, request_line, serving, wait_for

BOUNDARY = "vbatchboundary"


@contextmanager
def running(settings: Settings) -> Iterator[int]:
    """`vbatch serve`'s app and server options, over the fake engine."""
    settings.port = free_port()
    app = create_app(settings, EngineService(FakeEngine()))
    with serving(app, **server_options(settings)) as port:
        yield port


@pytest.fixture
def guarded(settings: Settings) -> Iterator[int]:
    settings.header_timeout_seconds = 1.0
    settings.min_body_bytes_per_second = 1000
    with running(settings) as port:
        yield port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(15)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def upload_request(body: bytes, declared: int | None = None) -> tuple[bytes, bytes]:
    form = (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        ).encode()
        + body
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {declared or len(form)}\r\n\r\n"
    ).encode()
    return head, form


def test_headers_that_never_finish_are_cut_off(guarded):
    silent, trickling = connect(guarded), connect(guarded)
    trickling.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    started = time.monotonic()
    assert read_all(silent) == b"" and read_all(trickling) == b""
    assert time.monotonic() - started < 1.0 + 5


def test_a_body_behind_its_pace_gets_408_and_stores_nothing(guarded, settings):
    head, form = upload_request(jsonl([request_line(f"r{i}") for i in range(200)]))
    sock = connect(guarded)
    sock.sendall(head + form[:300])  # then nothing more
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    assert [p.name for p in settings.files_dir.iterdir()] == []


def test_a_slow_body_that_keeps_its_pace_is_stored(guarded):
    head, form = upload_request(jsonl([request_line(f"r{i}") for i in range(12)]))
    assert len(form) > 1500  # so that it takes more than the grace at the pace below
    sock = connect(guarded)
    sock.sendall(head)
    for offset in range(0, len(form), 750):
        sock.sendall(form[offset : offset + 750])
        time.sleep(0.5)  # the client's pace (1,500 bytes a second), not a wait for the server
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_one_address_holds_at_most_its_share_of_connections(settings):
    settings.max_connections_per_client = 3
    with running(settings) as port:
        held = [connect(port) for _ in range(3)]
        for sock in held:  # each is in use: the server has answered on it
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        refused = connect(port)
        assert read_all(refused) == b""
        held.pop().close()
        wait_for(lambda: _health_over_new_connection(port))
        for sock in held:
            sock.close()


def _health_over_new_connection(port: int) -> bool:
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return read_all(sock).startswith(b"HTTP/1.1 200")
