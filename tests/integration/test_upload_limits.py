"""Upload limits on a real socket: an upload over its limit gets 413 before the client has sent its body, and
nothing of it is stored; whatever the filename, nothing is written outside the data directory."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from app.core.config import Settings
from tests.live import live_app

LIMIT = 64 * 1024
BOUNDARY = "vbatch-test-boundary"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", max_batch_upload_bytes=LIMIT, max_upload_bytes=4 * LIMIT)


def form_head(purpose: str | None) -> bytes:
    head = b""
    if purpose is not None:
        head += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'.encode()
    head += (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    return head


def request_head(extra: str) -> bytes:
    return (
        "POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{extra}\r\n"
    ).encode()


def read_status(sock: socket.socket) -> int:
    sock.settimeout(20)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before a response"
        data += chunk
    return int(data.split(b" ", 2)[1])


def stored(settings: Settings) -> list[str]:
    return sorted(p.name for p in settings.files_dir.iterdir())


def test_declared_length_over_the_limit_is_refused_before_any_body(settings):
    with live_app(settings) as address, socket.create_connection(address) as sock:
        sock.sendall(request_head(f"Content-Length: {100 * LIMIT}\r\n"))
        assert read_status(sock) == 413
    assert stored(settings) == []


def test_streamed_upload_is_refused_as_it_passes_the_limit(settings):
    """Chunked, so the server cannot know the size: it must count, and answer before the body ends."""
    with live_app(settings) as address, socket.create_connection(address) as sock:
        sock.sendall(request_head("Transfer-Encoding: chunked\r\n"))
        payload = form_head("batch") + b"x" * (LIMIT + 1)
        for start in range(0, len(payload), 8192):
            piece = payload[start : start + 8192]
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        # The rest of the file and the closing boundary are never sent.
        assert read_status(sock) == 413
    assert stored(settings) == []


def test_purpose_after_the_file_still_gets_its_own_limit(settings):
    body = form_head(None) + b"x" * (LIMIT + 1)
    purpose_part = f'\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    body += (purpose_part + f"--{BOUNDARY}--\r\n").encode()
    with live_app(settings) as (host, port):
        response = httpx.post(
            f"http://{host}:{port}/v1/files",
            content=body,
            headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
        )
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"
    assert stored(settings) == []


@pytest.mark.parametrize(
    "filename",
    [
        "../../escaped.jsonl",
        "/tmp/absolute.jsonl",
        "..",
        "a/b/c.jsonl",
        "..\\..\\win.jsonl",
        "%2e%2e%2fenc",
        "nul\x00.jsonl",
        "\u00e9" * 300,
    ],
)
def test_no_filename_becomes_a_path(settings, tmp_path, filename):
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with live_app(settings) as (host, port):
        response = httpx.post(
            f"http://{host}:{port}/v1/files", files={"file": (filename, b"{}\n")}, data={"purpose": "batch"}
        )
        assert response.status_code == 200, response.text
        created = response.json()
    after = sorted(str(p) for p in tmp_path.rglob("*"))
    new = set(after) - set(before)
    assert all(Path(p).is_relative_to(settings.data_dir) for p in new), new
    assert stored(settings) == [created["id"]]
    assert created["bytes"] == 3


def raw_request(path: str, headers: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode()


def test_a_stranger_is_refused_before_the_body_is_read(tmp_path):
    keyed = Settings(data_dir=tmp_path / "keyed", api_keys="sk-right")
    with live_app(keyed) as address, socket.create_connection(address) as sock:
        # 200 MB announced, none of it sent: the answer cannot wait for the body.
        sock.sendall(raw_request("/v1/batches", "Content-Type: application/json\r\nContent-Length: 200000000\r\n"))
        assert read_status(sock) == 401
    with live_app(keyed) as address, socket.create_connection(address) as sock:
        sock.sendall(raw_request("/v1/files", f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                                 "Authorization: Bearer sk-wrong\r\nContent-Length: 200000000\r\n"))  # fmt: skip
        assert read_status(sock) == 401


def test_json_bodies_are_bounded_declared_or_streamed(settings):
    over = settings.max_json_body_bytes + 1
    with live_app(settings) as address, socket.create_connection(address) as sock:
        sock.sendall(raw_request("/v1/batches", f"Content-Type: application/json\r\nContent-Length: {over}\r\n"))
        assert read_status(sock) == 413
    with live_app(settings) as (host, port):
        chunks = (b'{"metadata": {"k": "' + b"x" * 8192 for _ in range(over // 8192 + 2))
        response = httpx.post(
            f"http://{host}:{port}/v1/batches", content=chunks, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        small = httpx.post(f"http://{host}:{port}/v1/batches", json={"input_file_id": "file-x"})
        assert small.status_code == 400 and small.json()["error"]["param"] == "endpoint"
