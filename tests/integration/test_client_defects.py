"""Defects outside clients (the openai SDKs, LiteLLM, curl) found: each test failed before its fix."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from openai import OpenAI

from app.core import clock
from app.core.config import Settings
from app.openapi import served_openapi
from app.testing import FAKE_MODEL as MODEL
from tests.helpers import app_on, create_batch, jsonl, request_line, upload


def sdk(client, *, max_retries: int = 0) -> tuple[OpenAI, list[httpx.Request]]:
    """The official SDK over the TestClient's transport (the real app, no socket), and every request it sent."""
    sent: list[httpx.Request] = []
    client.event_hooks["request"] = [sent.append]
    return OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client, max_retries=max_retries), sent


# 1. Pagination when the cursor object is gone.


def test_deleting_while_iterating_pages_on(client):
    ids = {upload(client, jsonl([request_line(f"r{i}")]))["id"] for i in range(5)}
    openai_client, _ = sdk(client)
    deleted = []
    # What cleanup scripts do: the SDK asks for each next page after an object the loop has just deleted.
    for f in openai_client.files.list(limit=2):
        openai_client.files.delete(f.id)
        deleted.append(f.id)
    assert sorted(deleted) == sorted(ids)
    assert client.get("/v1/files").json()["data"] == []


def test_cursor_of_a_deleted_file_pages_on_from_where_it_stood(client):
    ids = [upload(client, jsonl([request_line(f"r{i}")]))["id"] for i in range(4)]  # oldest first
    newest_first = list(reversed(ids))
    client.delete(f"/v1/files/{newest_first[1]}")
    page = client.get("/v1/files", params={"after": newest_first[1], "limit": 10})
    assert page.status_code == 200, page.text
    assert [f["id"] for f in page.json()["data"]] == newest_first[2:]


def test_cursor_of_an_expired_file_pages_on(client, monkeypatch):
    short = client.post(
        "/v1/files",
        files={"file": ("a.jsonl", jsonl([request_line("a")]))},
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"},
    ).json()
    older = upload(client, jsonl([request_line("b")]))
    newer = upload(client, jsonl([request_line("c")]))
    later = clock.now() + 7200
    monkeypatch.setattr(clock, "now", lambda: later)
    ascending = client.get("/v1/files", params={"after": short["id"], "order": "asc"}).json()
    assert [f["id"] for f in ascending["data"]] == [older["id"], newer["id"]]


def test_another_keys_deleted_cursor_stays_unknown(tmp_path):
    settings = Settings(data_dir=tmp_path / "d", api_keys="sk-a,sk-b")
    with app_on(settings) as raw:
        a = {"Authorization": "Bearer sk-a"}
        b = {"Authorization": "Bearer sk-b"}
        mine = raw.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "user_data"}, headers=a)
        file_id = mine.json()["id"]
        raw.delete(f"/v1/files/{file_id}", headers=a)
        assert raw.get("/v1/files", params={"after": file_id}, headers=a).status_code == 200
        other = raw.get("/v1/files", params={"after": file_id}, headers=b)
        assert other.status_code == 400
        assert other.json()["error"]["param"] == "after"


# 2. Malformed JSON bodies.


def test_malformed_json_body_is_invalid_json(client):
    response = client.post("/v1/batches", content=b"{bad", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "We could not parse the JSON body of your request.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/batches/estimate"])
def test_json_that_is_not_an_object_says_so_and_json_too_deep_is_invalid_json(client, path):
    for body in (b"[{}]", b'"x"', b"1"):
        error = client.post(path, content=body, headers={"content-type": "application/json"}).json()["error"]
        assert (error["message"], error["code"]) == ("The body of your request must be a JSON object.", "invalid_json")
    deep = b"[" * 100_000 + b"]" * 100_000
    answer = client.post(path, content=deep, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_json"


def test_an_argument_openai_does_not_know_is_refused_by_name(client):
    file_id = upload(client, jsonl([request_line("a")]))["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for path in ("/v1/batches", "/v1/batches/estimate"):
        answer = client.post(path, json={**body, "output_expires_afer": {"anchor": "created_at", "seconds": 3600}})
        assert answer.status_code == 400
        assert answer.json()["error"] == {
            "message": "Unrecognized request argument supplied: 'output_expires_afer'.",
            "type": "invalid_request_error",
            "param": "output_expires_afer",
            "code": "unknown_parameter",
        }
    assert client.get("/v1/batches").json()["data"] == []  # nothing was created
    refused = client.post("/v1/batches/batch_x/retry", json={"metadata": {}, "foo": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "foo"


def test_empty_body_names_the_first_missing_parameter(client):
    response = client.post("/v1/batches", content=b"", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Missing required parameter: 'input_file_id'.",
        "type": "invalid_request_error",
        "param": "input_file_id",
        "code": "missing_required_parameter",
    }


# 3. 429 headers.


def test_too_many_active_batches_is_not_retried_by_the_sdk(client, settings, fake_engine):
    settings.max_active_batches_per_key = 1
    fake_engine.executor.answer_first = 0  # hold the first batch in progress
    file_id = upload(client, jsonl([request_line("a")]))["id"]
    create_batch(client, file_id)
    response = client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) > 0
    assert response.headers["x-should-retry"] == "false"
    openai_client, sent = sdk(client, max_retries=2)
    before = len(sent)
    with pytest.raises(openai.RateLimitError):
        openai_client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert len(sent) - before == 1


# 4. The OpenAPI document declares what the server answers.


def test_openapi_declares_no_422():
    document = served_openapi()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], f"{method.upper()} {path}"
            takes_input = operation.get("parameters") or operation.get("requestBody")
            assert "400" in operation["responses"] or not takes_input, f"{method.upper()} {path}"
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas


# 5. Uploads.


@pytest.mark.parametrize("content", [b"", b"\n \n", b"\xef\xbb\xbf\n", b"\xef\xbb\xbf"])
def test_empty_upload_is_400_and_stores_nothing(client, settings, content):
    response = client.post("/v1/files", files={"file": ("e.jsonl", content)}, data={"purpose": "batch"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "empty_file"
    assert response.json()["error"]["param"] == "file"
    assert client.get("/v1/files").json()["data"] == []
    assert list(settings.files_dir.iterdir()) == []


@pytest.mark.parametrize("content", [b"name,label\napple,fruit\n", b"\x89PNG\r\n\x1a\n\x00\x00", b"[1, 2]\n"])
def test_batch_upload_that_is_not_jsonl_is_400(client, content):
    response = client.post("/v1/files", files={"file": ("data.csv", content)}, data={"purpose": "batch"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_file_format"
    assert response.json()["error"]["param"] == "file"
    assert client.get("/v1/files").json()["data"] == []


def test_user_data_upload_need_not_be_jsonl(client):
    assert upload(client, b"name,label\n", purpose="user_data")["bytes"] == 11


def test_expires_after_as_a_json_string_is_honoured(client):
    response = client.post(
        "/v1/files",
        files={"file": ("x.jsonl", b"{}\n")},
        data={"purpose": "user_data", "expires_after": '{"anchor": "created_at", "seconds": 7200}'},
    )
    assert response.status_code == 200, response.text
    assert response.json()["expires_at"] == response.json()["created_at"] + 7200


def test_expires_after_as_a_bad_json_string_is_400(client):
    response = client.post(
        "/v1/files",
        files={"file": ("x.jsonl", b"{}\n")},
        data={"purpose": "user_data", "expires_after": "soon"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "expires_after"
    assert response.json()["error"]["code"] == "invalid_value"


def test_unknown_form_field_is_400(client):
    response = client.post(
        "/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch", "purpos": "batch"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "purpos"
    assert response.json()["error"]["code"] == "unknown_parameter"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "last_used", "expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ],
)
def test_expires_after_errors_carry_a_code(client, fields, param):
    response = client.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch", **fields})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["code"] == "invalid_value"


# 6. GET /v1/models/{id}.


def test_models_retrieve_through_the_sdk(client):
    openai_client, _ = sdk(client)
    model = openai_client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "vbatch")
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.models.retrieve("no-such-model")
    assert raised.value.body["param"] == "model"
    assert raised.value.body["code"] == "model_not_found"


def test_uploaded_bytes_reach_the_sdk_unchanged(client):
    openai_client, _ = sdk(client)
    content = jsonl([request_line("x")])
    created = openai_client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert openai_client.files.content(created.id).content == content
