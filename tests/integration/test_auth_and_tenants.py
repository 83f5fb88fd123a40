"""API keys and tenants over every endpoint: no key or a wrong one gets OpenAI's 401; another key's files and
batches are 404 everywhere and absent from its lists; the owner's data is untouched by the other's attempts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.auth import KeyRing, open_binding_refusal, read_keys
from app.core.config import Settings
from tests.helpers import jsonl, request_line, wait_status

pytestmark = pytest.mark.both_backends

KEY_A, KEY_B, KEY_IN_FILE = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210", "sk-from-the-file-42"
ENDPOINTS = [
    ("get", "/v1/models"),
    ("get", "/v1/files"),
    ("post", "/v1/files"),
    ("get", "/v1/files/file-x"),
    ("delete", "/v1/files/file-x"),
    ("get", "/v1/files/file-x/content"),
    ("get", "/v1/batches"),
    ("post", "/v1/batches"),
    ("get", "/v1/batches/batch_x"),
    ("post", "/v1/batches/batch_x/cancel"),
    ("get", "/v1/batches/batch_x/partial_output"),
]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# one key a line\n\n{KEY_IN_FILE}\n")
    return Settings(data_dir=tmp_path / "data", api_keys=f"{KEY_A}, {KEY_B}", api_keys_file=keys_file)


def as_key(client: TestClient, key: str) -> TestClient:
    client.headers["Authorization"] = f"Bearer {key}"
    return client


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize(
    ("authorization", "code"),
    [(None, None), ("Bearer sk-wrong", "invalid_api_key"), (f"Basic {KEY_A}", None), ("Bearer ", None)],
)
def test_every_endpoint_needs_a_known_key(client, method, path, authorization, code):
    headers = {} if authorization is None else {"Authorization": authorization}
    response = client.request(method, path, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] is None
    assert KEY_A not in response.text and "sk-wrong" not in response.text


def test_health_needs_no_key_and_each_configured_key_works(client):
    assert client.get("/health").status_code == 200
    for key in (KEY_A, KEY_B, KEY_IN_FILE):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_the_key_ring_keeps_digests_only_and_owners_are_stable():
    ring = KeyRing(read_keys(inline=f"{KEY_A},{KEY_B}", path=None))
    assert KEY_A not in repr(vars(ring)) and len(ring) == 2
    owner_a = ring.owner(f"Bearer {KEY_A}")
    assert owner_a == ring.owner(f"bearer  {KEY_A}") != ring.owner(f"Bearer {KEY_B}")
    assert KeyRing([]).owner(None) == ""


def test_another_key_sees_nothing_of_a_tenant_and_changes_nothing(client, fake_engine):
    owner = as_key(client, KEY_A)
    content = jsonl([request_line(f"r{i}") for i in range(3)])
    file_id = owner.post("/v1/files", files={"file": ("a.jsonl", content)}, data={"purpose": "batch"}).json()["id"]
    batch = owner.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    done = wait_status(owner, batch["id"], {"completed"})
    output_id = done["output_file_id"]

    other = TestClient(client.app, headers={"Authorization": f"Bearer {KEY_B}"})  # the running app, another key
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/files/{output_id}"):
        assert other.get(path).status_code == 404
    assert other.delete(f"/v1/files/{file_id}").status_code == 404
    for path in (f"/v1/batches/{batch['id']}", f"/v1/batches/{batch['id']}/partial_output"):
        assert other.get(path).status_code == 404
    assert other.post(f"/v1/batches/{batch['id']}/cancel").status_code == 404
    stolen = other.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "input_file_id"
    assert other.get("/v1/files").json()["data"] == []
    assert other.get("/v1/batches").json()["data"] == []
    # A cursor naming someone else's object is as unknown as one naming nothing.
    assert other.get("/v1/files", params={"after": file_id}).status_code == 400
    assert other.get("/v1/batches", params={"after": batch["id"]}).status_code == 400

    assert owner.get(f"/v1/files/{file_id}/content").content == content
    assert len(owner.get(f"/v1/files/{output_id}/content").content.splitlines()) == 3
    assert {f["id"] for f in owner.get("/v1/files").json()["data"]} == {file_id, output_id}
    assert owner.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed"
    assert fake_engine.executor.calls == 3


@pytest.mark.parametrize(
    ("host", "keys", "insecure", "refused"),
    [
        ("127.0.0.1", 0, False, False),
        ("localhost", 0, False, False),
        ("::1", 0, False, False),
        ("0.0.0.0", 0, False, True),
        ("192.168.1.5", 0, False, True),
        ("example.org", 0, False, True),
        ("0.0.0.0", 0, True, False),
        ("0.0.0.0", 2, False, False),
    ],
)
def test_without_keys_only_loopback_is_served_unless_insecure_is_explicit(host, keys, insecure, refused):
    refusal = open_binding_refusal(host=host, keys=keys, insecure_no_auth=insecure)
    assert (refusal is not None) == refused
