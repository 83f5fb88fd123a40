"""The console over the fake engine, through HTTP: sessions and CSRF, tenants, the upload check, the refusals.
The browser drives the same pages in tests/browser; these are the fast checks of each rule."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient

from app.console import sessions as sessions_module
from app.console.sessions import COOKIE, LIFETIME_SECONDS, SessionSigner, load_secret
from app.core.auth import ANONYMOUS, KeyRing, owner_of
from app.core.config import Settings
from app.core.gpu import GpuUsage, _parse
from app.main import create_app
from tests.helpers import create_batch, jsonl, request_line, upload, wait_status

pytestmark = pytest.mark.both_backends

KEY_A, KEY_B = "sk-console-a-0123456789", "sk-console-b-9876543210"
CSRF = re.compile(r'<meta name="csrf-token" content="([^"]*)">')


def csrf_of(client: TestClient, page: str = "/console/batches") -> str:
    response = client.get(page)
    assert response.status_code == 200, response.text
    token = CSRF.search(response.text)
    assert token is not None and token.group(1)
    return token.group(1)


def test_without_keys_a_visit_gets_a_session_and_sees_the_batches(client):
    batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
    first = client.get("/console/batches", follow_redirects=False)
    assert first.status_code == 303 and "httponly" in first.headers["set-cookie"].lower()
    assert "samesite=strict" in first.headers["set-cookie"].lower()
    page = client.get("/console/batches")
    assert page.status_code == 200 and batch["id"] in page.text
    wait_status(client, batch["id"], {"completed"})
    panel = client.get(f"/console/batches/{batch['id']}/panel")
    assert 'data-final="true"' in panel.text and "1 of 1 done" in panel.text


def test_a_change_without_the_csrf_token_or_from_another_origin_is_refused(client, fake_engine):
    fake_engine.executor.answer_first = 0  # the batch stays in progress until the gate opens
    batch = create_batch(client, upload(client, jsonl([request_line(f"r{i}") for i in range(3)]))["id"])
    token = csrf_of(client)
    cancel = f"/console/batches/{batch['id']}/cancel"
    assert client.post(cancel, follow_redirects=False).status_code == 403
    assert client.post(cancel, data={"csrf_token": "forged"}, follow_redirects=False).status_code == 403
    foreign = client.post(
        cancel, data={"csrf_token": token}, headers={"Origin": "http://evil.example"}, follow_redirects=False
    )
    assert foreign.status_code == 403
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] in {"validating", "in_progress"}
    done = client.post(cancel, data={"csrf_token": token}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == f"/console/batches/{batch['id']}"
    fake_engine.executor.gate.set()
    assert wait_status(client, batch["id"], {"cancelled"})["status"] == "cancelled"


def test_the_upload_check_reports_problems_by_line_and_needs_the_token(client, settings):
    lines = jsonl([request_line("ok-1"), request_line("ok-1"), request_line("x", url="/v1/completions")])
    content = lines + b"not json\n"
    files = {"file": ("bad.jsonl", content)}
    token = csrf_of(client)
    refused = client.post("/console/uploads", files=files, data={"purpose": "batch"})
    assert refused.status_code == 403
    assert client.get("/v1/files").json()["data"] == []
    checked = client.post(
        "/console/uploads", files=files, data={"purpose": "batch"}, headers={"X-CSRF-Token": token}
    ).json()
    assert checked["error_count"] == 3 and checked["total"] == 4
    assert [(p["line"], p["code"]) for p in checked["problems"]] == [
        (2, "duplicate_custom_id"),
        (3, "mismatched_url"),
        (4, "invalid_json_line"),
    ]
    # The file is stored all the same: a batch of it fails validation with the same lines, shown on its page.
    form = {"csrf_token": token, "input_file_id": checked["file"]["id"], "endpoint": "/v1/chat/completions"}
    created = client.post("/console/batches", data=form | {"completion_window": "24h", "metadata": "team=a"})
    assert created.status_code == 200 and created.url.path.startswith("/console/batches/batch_")
    batch_id = created.url.path.rsplit("/", 1)[-1]
    failed = wait_status(client, batch_id, {"failed"})
    assert failed["metadata"] == {"team": "a"}
    panel = client.get(f"/console/batches/{batch_id}/panel").text
    assert "duplicate_custom_id" in panel and "invalid_json_line" in panel


def test_bad_metadata_is_an_error_page_and_creates_nothing(client):
    source = upload(client, jsonl([request_line("a")]))
    token = csrf_of(client)
    form = {"csrf_token": token, "input_file_id": source["id"], "endpoint": "/v1/chat/completions"}
    response = client.post("/console/batches", data=form | {"completion_window": "24h", "metadata": "no equals"})
    assert response.status_code == 400 and "not key=value" in response.text
    assert client.get("/v1/batches").json()["data"] == []


def test_a_file_a_running_batch_reads_is_not_deleted(client, fake_engine, settings):
    fake_engine.executor.answer_first = 0
    source = upload(client, jsonl([request_line("a"), request_line("b")]))
    batch = create_batch(client, source["id"])
    wait_status(client, batch["id"], {"in_progress"})
    token = csrf_of(client)
    refused = client.post(f"/console/files/{source['id']}/delete", data={"csrf_token": token})
    assert refused.status_code == 400 and batch["id"] in refused.text
    assert client.get(f"/v1/files/{source['id']}").status_code == 200
    fake_engine.executor.gate.set()
    wait_status(client, batch["id"], {"completed"})
    deleted = client.post(f"/console/files/{source['id']}/delete", data={"csrf_token": token}, follow_redirects=False)
    assert deleted.status_code == 303
    assert client.get(f"/v1/files/{source['id']}").status_code == 404
    assert not (settings.files_dir / source["id"]).exists()


def test_the_engine_page_shows_the_engine_settings(client):
    page = client.get("/console/engine").text
    assert "fake-model" in page and "max_num_seqs" in page and "nvidia-smi" in page


def logged_in(client: TestClient, key: str) -> TestClient:
    response = client.post("/console/login", data={"key": key, "next": "/console/files"}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/console/files"
    return client


def test_with_keys_the_console_asks_once_and_never_keeps_the_key(tmp_path, engine_service):
    settings = Settings(data_dir=tmp_path / "data", api_keys=f"{KEY_A},{KEY_B}", disk_reserve_bytes=65536)
    with TestClient(create_app(settings, engine_service)) as client:
        away = client.get("/console/batches/batch_x", follow_redirects=False)
        assert away.status_code == 303 and away.headers["location"] == "/console/login?next=/console/batches/batch_x"
        assert client.get("/console/batches/rows", headers={"X-Requested-With": "vbatch-console"}).status_code == 401
        wrong = client.post("/console/login", data={"key": "sk-wrong"})
        assert wrong.status_code == 401 and "not one this service knows" in wrong.text
        foreign = client.post("/console/login", data={"key": KEY_A}, headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403 and COOKIE not in client.cookies
        outward = client.post(
            "/console/login", data={"key": KEY_A, "next": "https://evil.example/"}, follow_redirects=False
        )
        assert outward.headers["location"] == "/console/batches"
        cookie = client.cookies[COOKIE]
        assert KEY_A not in cookie and KEY_A.encode().hex() not in cookie
        assert client.get("/console/batches").status_code == 200
        forged = cookie[:-4] + ("0000" if not cookie.endswith("0000") else "1111")
        client.cookies.clear()
        client.cookies.set(COOKIE, forged)
        assert client.get("/console/batches", follow_redirects=False).status_code == 303
        client.cookies.clear()
        client.cookies.set(COOKIE, cookie)
        assert client.get("/console/batches", follow_redirects=False).status_code == 200


def test_two_keys_see_disjoint_lists_and_each_others_batches_are_not_found(tmp_path, engine_service):
    settings = Settings(data_dir=tmp_path / "data", api_keys=f"{KEY_A},{KEY_B}", disk_reserve_bytes=65536)
    app = create_app(settings, engine_service)
    # One lifespan (the first client's): the others are more browsers on the same running app.
    with TestClient(app) as api:
        console_a, console_b = TestClient(app), TestClient(app)
        ids = {}
        for key in (KEY_A, KEY_B):
            api.headers["Authorization"] = f"Bearer {key}"
            ids[key] = create_batch(api, upload(api, jsonl([request_line("x")]))["id"])["id"]
        logged_in(console_a, KEY_A)
        logged_in(console_b, KEY_B)
        page_a, page_b = console_a.get("/console/batches").text, console_b.get("/console/batches").text
        assert ids[KEY_A] in page_a and ids[KEY_B] not in page_a
        assert ids[KEY_B] in page_b and ids[KEY_A] not in page_b
        assert console_a.get(f"/console/batches/{ids[KEY_B]}").status_code == 404
        assert console_a.get(f"/console/batches/{ids[KEY_B]}/progress.json").status_code == 404
        token = csrf_of(console_a)
        cancel = console_a.post(f"/console/batches/{ids[KEY_B]}/cancel", data={"csrf_token": token})
        assert cancel.status_code == 404
        # A's token is no good in B's session.
        assert console_b.post(f"/console/batches/{ids[KEY_B]}/cancel", data={"csrf_token": token}).status_code == 403


def test_a_session_is_refused_once_stale_or_altered(monkeypatch, tmp_path):
    signer = SessionSigner(load_secret(tmp_path))
    assert load_secret(tmp_path) == load_secret(tmp_path) and (tmp_path / "console-secret").stat().st_mode & 0o077 == 0
    session, cookie = signer.issue("owner-a")
    assert signer.read(cookie) == session
    encoded, signature = cookie.split(".")
    assert signer.read(f"{encoded}.{'0' * len(signature)}") is None
    assert signer.read(f"{encoded[:-2]}.{signature}") is None
    assert SessionSigner(b"another secret").read(cookie) is None
    assert signer.csrf_ok(session, signer.csrf_token(session))
    assert not signer.csrf_ok(signer.issue("owner-a")[0], signer.csrf_token(session))
    later = time.time() + LIFETIME_SECONDS + 1
    monkeypatch.setattr(sessions_module.time, "time", lambda: later)
    assert signer.read(cookie) is None


def test_a_session_ends_with_its_key():
    ring = KeyRing([KEY_A])
    assert ring.has_owner(owner_of(KEY_A)) and not ring.has_owner(owner_of(KEY_B))
    assert not KeyRing([KEY_B]).has_owner(owner_of(KEY_A)) and not ring.has_owner(ANONYMOUS)
    assert KeyRing([]).has_owner(ANONYMOUS) and not KeyRing([]).has_owner(owner_of(KEY_A))


def test_gpu_lines_parse_and_unreadable_ones_are_skipped():
    assert _parse("0, NVIDIA H200, 37, 1024, 143771") == GpuUsage(0, "NVIDIA H200", 37, 1024, 143771)
    assert _parse("1, NVIDIA H200, [N/A], 1024, 143771") is None and _parse("garbage") is None
