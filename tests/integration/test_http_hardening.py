"""The HTTP surface against outside testers' findings: a database that takes no writes, DNS rebinding (the Host
header), API docs, requests uvicorn cannot parse, and how a 500 is logged. Real servers and sockets where the
finding was about them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from app.api.connections import guarded_protocol
from app.core.config import Settings
from app.core.db import make_engine, session_scope
from app.core.migrate import upgrade_to_head
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.engine.service import EngineService
from app.launch import server_options
from app.main import create_app
from app.testing import FakeEngine, VbatchServer, free_port
from tests.helpers import app_on, create_batch, jsonl, request_line, serving, upload, wait_for

ROOT = Path(__file__).resolve().parents[2]
ATTACKER = "attacker.example"


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(15)
    return sock


def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on a connection of its own: the status, headers and body of the answer."""
    with connect(port) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection before answering: {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers.get("content-length", "0")):
            chunk = sock.recv(65536)
            assert chunk, "the body was cut short"
            body += chunk
    return int(lines[0].split()[1]), headers, body


def get(port: int, target: bytes, host: bytes = b"127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    return exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")


def envelope(body: bytes) -> dict:
    """The error envelope's `error`, asserting the body is exactly that envelope."""
    document = json.loads(body)
    assert set(document) == {"error"} and set(document["error"]) == {"message", "type", "param", "code"}
    return document["error"]


def settings_of(tmp_path: Path, **fields) -> Settings:
    return Settings(data_dir=tmp_path / "data", disk_reserve_bytes=65536, **fields)


@contextmanager
def running(settings: Settings, **options) -> Iterator[int]:
    """`vbatch serve`'s app and server options over the fake engine, on a real socket."""
    settings.port = free_port()
    app = create_app(settings, EngineService(FakeEngine()))
    with serving(app, **{**server_options(settings), **options}) as port:
        yield port


# 1. A database that takes no writes


def test_a_read_only_postgres_gets_503_on_writes(postgres, tmp_path):
    url = postgres.new_database()
    with app_on(settings_of(tmp_path, database_url=url)) as client:
        db = client.app.state.db  # type: ignore[attr-defined]
        with db.connect() as connection:
            connection.execute(text(f"ALTER DATABASE {make_url(url).database} SET default_transaction_read_only = on"))
            connection.commit()
        db.dispose()  # connections from now on are read-only
        refused = client.post(
            "/v1/files", files={"file": ("in.jsonl", jsonl([request_line("a")]))}, data={"purpose": "batch"}
        )
        assert refused.status_code == 503 and envelope(refused.content)["code"] == "database_unavailable"
        assert "read-only" in envelope(refused.content)["message"] and refused.headers["retry-after"]
        assert client.get("/v1/files").status_code == 200


def unprivileged(command: list[str]) -> list[str]:
    """Root writes a 0444 file anyway (CAP_DAC_OVERRIDE): without that capability, as a service user would."""
    if os.geteuid() != 0:
        return command
    return ["setpriv", "--bounding-set", "-dac_override", *command]


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root needs setpriv to drop a cap")
def test_a_read_only_database_is_named_by_health_and_writes_get_503(settings, tmp_path):
    with app_on(settings) as client:  # a service that ran before
        source = upload(client, jsonl([request_line("a")]))
    settings.database_path.chmod(0o444)
    port = free_port()
    command = [sys.executable, "-m", "app.testing", "--data-dir", str(settings.data_dir), "--port", str(port)]
    env = {**os.environ, "VBATCH_DISK_RESERVE_BYTES": "65536"}
    with (tmp_path / "serve.log").open("wb") as log:
        server = subprocess.Popen(unprivileged(command), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            health = wait_for(lambda: _answer(http, "/health"), timeout=60)
            assert health.status_code == 503, health.text
            assert health.json()["status"] == "unavailable"
            assert any("takes no writes" in problem for problem in health.json()["problems"])
            files = {"file": ("in.jsonl", jsonl([request_line("b")]))}
            body = {"input_file_id": source["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            uploaded = http.post("/v1/files", files=files, data={"purpose": "batch"})
            for refused in (uploaded, http.post("/v1/batches", json=body)):
                assert refused.status_code == 503, refused.text
                error = envelope(refused.content)
                assert (error["type"], error["code"]) == ("server_error", "database_unavailable")
                assert "takes no writes" in error["message"]
                assert int(refused.headers["retry-after"]) > 0
            assert http.get(f"/v1/files/{source['id']}").status_code == 200  # reads still work
            assert server.poll() is None
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def _answer(http: httpx.Client, path: str) -> httpx.Response | None:
    try:
        return http.get(path)
    except httpx.TransportError:
        return None


# 2. DNS rebinding: the Host header without keys


def test_without_keys_only_loopback_hosts_are_served(tmp_path):
    with running(settings_of(tmp_path, allowed_hosts="")) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            source = upload(http, jsonl([request_line("a")]))
            batch = create_batch(http, source["id"])
        rebound = f"{ATTACKER}:{port}".encode()
        cancel = (
            f"POST /v1/batches/{batch['id']}/cancel HTTP/1.1\r\nHost: {ATTACKER}:{port}\r\n"
            f"Origin: http://{ATTACKER}:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ).encode()
        for status, headers, body in (
            get(port, b"/v1/files", rebound),
            get(port, f"/v1/files/{source['id']}/content".encode(), rebound),
            get(port, b"/console/login", rebound),
            get(port, b"/metrics", rebound),
            get(port, b"/openapi.json", rebound),
            exchange(port, cancel),
        ):
            assert status == 400 and envelope(body)["code"] == "host_not_allowed"
            assert headers["x-request-id"]
        for host in (f"localhost:{port}", "127.0.0.2", f"[::1]:{port}", "LOCALHOST."):
            assert get(port, f"/v1/files/{source['id']}".encode(), host.encode())[0] == 200, host
        assert get(port, b"/health", rebound)[0] == 200


@pytest.mark.parametrize(
    ("keys", "allowed", "served"),
    [
        ("", "vbatch.internal, other.example:8000", {"VBATCH.internal:1234", "other.example"}),  # a port or none
        ("sk-a", "", {"VBATCH.internal:1234", "other.example", ATTACKER}),  # keys are the defence
        ("sk-a", "vbatch.internal", {"VBATCH.internal:1234"}),  # given, the setting holds with keys too
        ("", "*", {"VBATCH.internal:1234", "other.example", ATTACKER}),
    ],
)
def test_allowed_hosts_widen_the_host_rule_and_keys_lift_it(tmp_path, keys, allowed, served):
    settings = settings_of(tmp_path, api_keys=keys, allowed_hosts=allowed)
    with app_on(settings) as client:
        for host in ("VBATCH.internal:1234", "other.example", ATTACKER):
            response = client.get("/v1/files", headers={"host": host, "authorization": "Bearer sk-a"})
            assert response.status_code == (200 if host in served else 400), host


# 3. API docs


def test_docs_are_off_by_default(client):
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").status_code == 200  # no keys: no key needed


def test_openapi_json_needs_a_key_when_keys_are_configured(settings):
    settings.api_keys = "sk-a"
    with app_on(settings) as client:
        refused = client.get("/openapi.json")
        assert refused.status_code == 401 and envelope(refused.content)["type"] == "invalid_request_error"
        served = client.get("/openapi.json", headers={"authorization": "Bearer sk-a"})
        assert served.status_code == 200 and "/v1/batches" in served.json()["paths"]


def test_docs_can_be_turned_on(tmp_path):
    with app_on(settings_of(tmp_path, api_docs=True)) as client:
        assert client.get("/docs").status_code == 200 and client.get("/redoc").status_code == 200


# 4. Requests uvicorn cannot parse, and URLs that are not UTF-8


@pytest.fixture(params=["auto", "h11"])
def parser_port(request, settings) -> Iterator[tuple[str, int]]:
    """`vbatch serve`'s own protocol (httptools where installed), and the one on h11."""
    if request.param == "auto":
        with running(settings) as port:
            yield ("httptools" if importlib.util.find_spec("httptools") else "h11"), port
        return
    protocol = guarded_protocol(header_timeout=10, max_per_client=100, parser="h11")
    with running(settings, http=protocol) as port:
        yield "h11", port


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v1/\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # not ASCII in the request line
        b"GET /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
        b"HELLO\r\n\r\n",
    ],
)
def test_what_the_parser_refuses_gets_the_envelope(parser_port, request_bytes):
    _, port = parser_port
    status, headers, body = exchange(port, request_bytes)
    assert status == 400 and headers["content-type"] == "application/json"
    assert envelope(body)["code"] == "invalid_http_request" and headers["x-request-id"]


def test_a_url_past_the_parser_s_limits_gets_414_in_the_envelope(parser_port):
    parser, port = parser_port
    head = b"GET /v1/files/" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    # h11 refuses a head that outgrows its buffer before the head ends; httptools refuses the URL once it is whole.
    status, headers, body = exchange(port, head if parser == "h11" else head + b"\r\n")
    assert status == 414 and envelope(body)["code"] == "url_too_long" and headers["connection"] == "close"


def test_h11_refuses_a_long_query_with_414_and_long_headers_with_431(settings):
    protocol = guarded_protocol(header_timeout=10, max_per_client=100, parser="h11")
    with running(settings, http=protocol) as port:
        query = b"GET /v1/files?after=" + b"a" * 60_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        status, _, body = exchange(port, query)
        assert status == 414 and envelope(body)["code"] == "url_too_long"
        headers = b"GET /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 60_000 + b"\r\n"
        status, _, body = exchange(port, headers)
        assert status == 431 and envelope(body)["code"] == "headers_too_large"


def test_a_url_that_is_not_utf8_once_unescaped_is_a_400(settings):
    with running(settings) as port:
        for target in (b"/v1/files/%ff", b"/v1/batches/%ff%fe/cancel", b"/v1/files?after=%ff", b"/health/%c3"):
            status, headers, body = get(port, target)
            assert status == 400 and envelope(body)["code"] == "invalid_url" and headers["x-request-id"], target


# 5. A 500 is logged once, with its access record


def test_a_500_logs_one_traceback_and_one_access_record(tmp_path):
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir)
    upgrade_to_head(settings.database)
    db = make_engine(settings.database)
    with session_scope(db) as session:  # a row this version cannot read (another version's, or a damaged one)
        session.add(_unreadable_batch())
        session.commit()
    db.dispose()
    port = free_port()
    env = {"VBATCH_LOG_FORMAT": "json", "VBATCH_DISK_RESERVE_BYTES": "65536"}
    server = VbatchServer(data_dir, port, [], tmp_path / "serve.log", env, fake_engine=True)
    try:
        server.wait_ready(timeout=60)
        response = httpx.get(f"{server.base_url}/v1/batches/batch_unreadable", headers={"x-request-id": "req-500"})
    finally:
        server.stop()
    records = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("{")]
    tracebacks = [r["exc_info"] for r in records if "exc_info" in r]
    assert len(tracebacks) == 1 and "JSONDecodeError" in tracebacks[0], tracebacks
    access = [r for r in records if r.get("logger") == "vbatch.access" and r.get("request_id") == "req-500"]
    assert [(r["status"], r["path"]) for r in access] == [(500, "/v1/batches/batch_unreadable")]
    assert response.status_code == 500 and envelope(response.content)["type"] == "server_error"
    assert response.headers["x-request-id"] == "req-500"


def _unreadable_batch() -> BatchRow:
    now = time.time_ns()
    return BatchRow(
        id="batch_unreadable",
        created_ns=now,
        endpoint="/v1/chat/completions",
        input_file_id="file-gone",
        completion_window="24h",
        status=BatchStatus.COMPLETED,
        created_at=now // 10**9,
        completed_at=now // 10**9,
        metadata_json="{not json",
    )
