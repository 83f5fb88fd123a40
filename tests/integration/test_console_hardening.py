"""The console against what outside testers sent it: odd bytes in its cookie and CSRF token (over a real socket),
a cookie copied before logout, the headers that keep its pages from being framed or sniffed, the cookie's Secure
flag behind a TLS proxy, and a browser pointed at the base URL."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from sqlmodel import select

from app.console import sessions
from app.console.sessions import COOKIE, LIFETIME_SECONDS, Session, SessionSigner
from app.core.config import Settings
from app.core.db import make_engine, session_scope
from app.core.migrate import upgrade_to_head
from app.domain import models
from app.engine.online.view import WorkersView
from app.engine.service import EngineService
from app.launch import server_options
from app.main import Role, create_app
from app.testing import FakeEngine, free_port
from tests.helpers import app_on, create_batch, jsonl, request_line, serving, upload
from tests.integration.test_console import CSRF, KEY_A, KEY_B, csrf_of, logged_in

# A cookie whose payload decodes (`x.1.y`) and whose signature is one Latin-1 byte: what made hmac raise.
ODD_COOKIE = b"vbatch_console=eC4xLnk.\xe9"
SCRIPT = {"X-Requested-With": "vbatch-console"}


def with_keys(settings: Settings, **changes) -> Settings:
    return settings.model_copy(update={"api_keys": f"{KEY_A},{KEY_B}", **changes})


@contextmanager
def live(settings: Settings) -> Iterator[httpx.Client]:
    """`vbatch serve`'s app with its uvicorn options on a loopback socket, and a client of it."""
    settings.port = free_port()
    app = create_app(settings, EngineService(FakeEngine()))
    with serving(app, **server_options(settings)) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        yield client


def token_of(client: httpx.Client) -> str:
    match = CSRF.search(client.get("/console/batches").text)
    assert match is not None and match.group(1)
    return match.group(1)


# 1. Odd bytes in the cookie or the CSRF token: a login page or a fresh session, and 403; never a 500.


def test_an_odd_byte_in_the_cookie_is_a_fresh_session_without_keys(settings):
    with live(settings) as client:
        for cookie in (ODD_COOKIE, b"vbatch_console=\xe9\xff.abc", b"vbatch_console=\xe9"):
            answer = client.get("/console/batches", headers={"Cookie": cookie})
            assert answer.status_code == 303, (cookie, answer.status_code)
            assert answer.headers["location"].endswith("/console/batches")
            assert f"{COOKIE}=" in answer.headers["set-cookie"]


def test_an_odd_byte_in_the_cookie_is_the_login_page_with_keys(settings):
    with live(with_keys(settings)) as client:
        for path in ("/console/batches", "/console/files", "/console/batches/batch_x/panel"):
            answer = client.get(path, headers={"Cookie": ODD_COOKIE})
            assert answer.status_code == 303, (path, answer.status_code)
            assert answer.headers["location"].startswith("/console/login?next=")
        fragment = client.get("/console/batches/rows", headers={"Cookie": ODD_COOKIE, **SCRIPT})
        assert fragment.status_code == 401


def test_an_odd_byte_in_the_csrf_token_is_403(settings):
    with live(with_keys(settings)) as client:
        login = client.post("/console/login", data={"key": KEY_A})
        assert login.status_code == 303
        token = token_of(client)
        odd_header = client.post("/console/logout", headers={"X-CSRF-Token": b"\xe9" + token[1:].encode()})
        assert odd_header.status_code == 403
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        for body in (b"csrf_token=%C3%A9", b"csrf_token=\xe9\xff", b"csrf_token=%ED%B0%80"):
            assert client.post("/console/logout", content=body, headers=form).status_code == 403, body
        assert client.post("/console/logout", data={"csrf_token": token}).status_code == 303


@given(text=st.text(), lone=st.sampled_from(["\udc00", "\ud800x", "a\udfff"]))
def test_reading_any_cookie_or_token_never_raises(text, lone):
    signer = SessionSigner(b"a secret")
    session, cookie = signer.issue("owner-a")
    encoded = cookie.split(".")[0]
    for given_cookie in (text, f"{encoded}.{text}", f"{encoded}.{lone}", f"{text}.{lone}"):
        assert signer.read(given_cookie) is None
    for token in (text, lone):
        assert signer.csrf_ok(session, token) is False
    assert signer.read(cookie) == session and signer.csrf_ok(session, signer.csrf_token(session))


# 2. Logout ends the session: a copy of the cookie stops working at once, in every replica.


@pytest.mark.both_backends
def test_a_cookie_copied_before_logout_stops_working_in_every_replica(settings):
    keyed = with_keys(settings)
    one_app, other_app = create_app(keyed, WorkersView(), Role.API), create_app(keyed, WorkersView(), Role.API)
    with TestClient(one_app) as one, TestClient(other_app) as other:
        logged_in(one, KEY_A)
        copied = one.cookies[COOKIE]
        other.cookies.set(COOKIE, copied)
        assert other.get("/console/batches", follow_redirects=False).status_code == 200
        token = csrf_of(one)
        assert one.post("/console/logout", data={"csrf_token": token}, follow_redirects=False).status_code == 303
        for client in (one, other):
            client.cookies.clear()
            client.cookies.set(COOKIE, copied)
            away = client.get("/console/batches", follow_redirects=False)
            assert away.status_code == 303 and away.headers["location"].startswith("/console/login")
            refused = client.post("/console/logout", data={"csrf_token": token}, follow_redirects=False)
            assert refused.status_code == 303 and refused.headers["location"].startswith("/console/login")
        # A new login is a new session, untouched by the old one's end.
        other.cookies.clear()
        logged_in(other, KEY_A)
        assert other.get("/console/batches", follow_redirects=False).status_code == 200


def test_ended_sessions_are_kept_until_their_cookies_expire(tmp_path):
    url = f"sqlite:///{tmp_path / 'vbatch.db'}"
    upgrade_to_head(url)
    db = make_engine(url)
    try:
        now = int(time.time())
        stale = Session(owner="owner-a", issued=now - LIFETIME_SECONDS - 5, nonce="stale")
        fresh = Session(owner="owner-a", issued=now, nonce="fresh")
        sessions.end(db=db, session=stale)
        sessions.end(db=db, session=fresh)
        sessions.end(db=db, session=fresh)  # a second logout (another tab) is no error
        assert sessions.ended(db=db, session=fresh)
        with session_scope(db) as read:
            kept = {row.nonce: row.expires_at for row in read.exec(select(models.EndedConsoleSession)).all()}
        assert kept == {"fresh": now + LIFETIME_SECONDS}  # the stale one's cookie is refused as stale anyway
    finally:
        db.dispose()


# 3. Headers: a strict CSP, no framing, no sniffing, the referrer kept to this origin.

EXPECTED_HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def assert_console_headers(response: httpx.Response) -> None:
    for name, value in EXPECTED_HEADERS.items():
        assert response.headers.get(name) == value, (response.url, name)
    policy = dict(part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"
    assert "unsafe" not in response.headers["content-security-policy"]


def test_console_pages_fragments_static_files_and_refusals_carry_the_headers(client):
    batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
    client.get("/console/batches")  # the session
    responses = [
        client.get("/console/batches"),
        client.get("/console/batches/rows", headers=SCRIPT),
        client.get(f"/console/batches/{batch['id']}/panel", headers=SCRIPT),
        client.get("/console/static/console.js"),
        client.get("/console/static/console.css"),
        client.get("/console/static/missing.js"),
        client.get("/console/batches/batch_missing"),
        client.post("/console/logout", follow_redirects=False),
    ]
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 200, 404, 404, 403]
    for response in responses:
        assert_console_headers(response)
    javascript = responses[3]
    assert javascript.headers["content-type"].startswith("text/javascript")
    cached = client.get("/console/static/console.js", headers={"If-None-Match": javascript.headers["etag"]})
    assert cached.status_code == 304
    assert_console_headers(cached)


INLINE = re.compile(r"<script(?![^>]*\bsrc=)|<style|\sstyle=|\son[a-z]+=|javascript:", re.IGNORECASE)


def test_every_page_satisfies_the_policy_with_no_inline_script_or_style(client, tmp_path):
    batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
    client.get("/console/batches")
    pages = ["/console/batches", f"/console/batches/{batch['id']}", "/console/submit", "/console/files"]
    pages += ["/console/engine", "/console/batches/batch_missing"]
    for page in pages:
        html = client.get(page).text
        assert INLINE.search(html) is None, (page, INLINE.search(html))
    keyed_settings = Settings(data_dir=tmp_path / "keyed", api_keys=KEY_A, disk_reserve_bytes=65536)
    with app_on(keyed_settings) as keyed:
        login = keyed.get("/console/login")
        assert login.status_code == 200 and INLINE.search(login.text) is None


# 4. The cookie's Secure flag: from the setting, or (auto) from the scheme uvicorn saw.


def login_cookie(settings: Settings, base_url: str) -> str:
    with TestClient(create_app(with_keys(settings), EngineService(FakeEngine())), base_url=base_url) as client:
        response = client.post("/console/login", data={"key": KEY_A}, follow_redirects=False)
        assert response.status_code == 303
        return response.headers["set-cookie"].lower()


def test_cookie_secure_true_or_false_overrides_the_scheme(settings):
    assert "; secure" in login_cookie(settings.model_copy(update={"cookie_secure": "true"}), "http://testserver")
    assert "; secure" not in login_cookie(settings.model_copy(update={"cookie_secure": "false"}), "https://testserver")
    assert "; secure" in login_cookie(settings, "https://testserver")
    assert "; secure" not in login_cookie(settings, "http://testserver")


def test_cookie_secure_auto_follows_x_forwarded_proto_from_a_loopback_proxy(settings):
    with live(with_keys(settings)) as client:
        behind_tls = client.post("/console/login", data={"key": KEY_A}, headers={"X-Forwarded-Proto": "https"})
        plain = client.post("/console/login", data={"key": KEY_A})
    assert behind_tls.status_code == plain.status_code == 303
    assert "; secure" in behind_tls.headers["set-cookie"].lower()
    assert "; secure" not in plain.headers["set-cookie"].lower()


# 5. The base URL in a browser.


def test_the_base_url_sends_a_browser_to_the_console(client):
    answer = client.get("/", follow_redirects=False)
    assert answer.status_code == 307 and answer.headers["location"] == "/console/"
    assert client.get("/").url.path == "/console/batches"
    assert "/" not in client.get("/openapi.json").json()["paths"]


def test_an_api_replica_redirects_too_and_a_worker_does_not(tmp_path):
    replica = Settings(data_dir=tmp_path / "shared", disk_reserve_bytes=65536)
    with TestClient(create_app(replica, WorkersView(), Role.API)) as api:
        assert api.get("/", follow_redirects=False).headers["location"] == "/console/"
    with TestClient(create_app(replica, EngineService(FakeEngine()), Role.WORKER)) as worker:
        assert worker.get("/", follow_redirects=False).status_code == 404
        assert worker.get("/console/batches", follow_redirects=False).status_code == 404
