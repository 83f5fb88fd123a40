from __future__ import annotations

import pytest

from tests.helpers import upload

pytestmark = pytest.mark.both_backends


def test_upload_returns_file_object_and_exact_bytes(client):
    content = b'{"a": 1}\n{"b": "\xc3\xa9"}\n'
    created = upload(client, content, filename="my data.jsonl")
    assert created["id"].startswith("file-")
    assert created["object"] == "file"
    assert created["bytes"] == len(content)
    assert created["filename"] == "my data.jsonl"
    assert created["purpose"] == "batch"
    assert created["status"] == "processed"
    assert created["status_details"] is None
    assert created["expires_at"] == created["created_at"] + 30 * 86400
    assert client.get(f"/v1/files/{created['id']}").json() == created
    download = client.get(f"/v1/files/{created['id']}/content")
    assert download.status_code == 200
    assert download.content == content


def test_expires_after_sets_expiry(client):
    response = client.post(
        "/v1/files",
        files={"file": ("x.jsonl", b"{}\n")},
        data={
            "purpose": "user_data",
            "expires_after[anchor]": "created_at",
            "expires_after[seconds]": "3600",
        },
    )
    body = response.json()
    assert body["expires_at"] == body["created_at"] + 3600


def test_expires_after_out_of_range_is_400(client):
    response = client.post(
        "/v1/files",
        files={"file": ("x.jsonl", b"{}\n")},
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "expires_after.seconds"


def test_non_batch_purpose_has_no_expiry(client):
    assert upload(client, b"x", purpose="user_data")["expires_at"] is None


def test_unknown_purpose_is_400_naming_param(client):
    response = client.post("/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "batch_output"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "purpose"


def test_missing_file_is_400(client):
    response = client.post("/v1/files", files={"purpose": (None, b"batch")})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Missing required parameter: 'file'.",
        "type": "invalid_request_error",
        "param": "file",
        "code": "missing_required_parameter",
    }


def test_upload_over_limit_is_413_and_stores_nothing(client, settings):
    settings.max_batch_upload_bytes = 10
    response = client.post("/v1/files", files={"file": ("x.jsonl", b"0123456789AB")}, data={"purpose": "batch"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "file_too_large"
    assert client.get("/v1/files").json()["data"] == []
    assert [p.name for p in settings.files_dir.iterdir()] == []


def test_delete_then_404(client, settings):
    created = upload(client, b"{}\n")
    response = client.delete(f"/v1/files/{created['id']}")
    assert response.json() == {"id": created["id"], "object": "file", "deleted": True}
    for path in (f"/v1/files/{created['id']}", f"/v1/files/{created['id']}/content"):
        missing = client.get(path)
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == f"No such File object: {created['id']}"
    assert client.delete(f"/v1/files/{created['id']}").status_code == 404
    assert not (settings.files_dir / created["id"]).exists()


def test_list_pagination_and_order(client):
    ids = [upload(client, f'{{"n": {i}}}\n'.encode())["id"] for i in range(5)]
    listing = client.get("/v1/files").json()
    assert [f["id"] for f in listing["data"]] == ids[::-1]
    assert listing["first_id"] == ids[-1] and listing["last_id"] == ids[0] and listing["has_more"] is False

    seen, after = [], None
    while True:
        params = {"limit": 2, "order": "asc", **({"after": after} if after else {})}
        page = client.get("/v1/files", params=params).json()
        seen += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert seen == ids
    past_end = client.get("/v1/files", params={"after": ids[-1], "order": "asc"}).json()
    assert past_end["data"] == [] and past_end["has_more"] is False and past_end["first_id"] is None


def test_list_filters_by_purpose(client):
    batch_file = upload(client, b'{"n": 1}\n')
    upload(client, b"2\n", purpose="user_data")
    listing = client.get("/v1/files", params={"purpose": "batch"}).json()
    assert [f["id"] for f in listing["data"]] == [batch_file["id"]]


def test_bad_limit_is_400_envelope(client):
    response = client.get("/v1/files", params={"limit": 0})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["param"] == "limit"


@pytest.mark.parametrize("length", [1025, 5000, 100_000])
def test_overlong_filename_is_400_and_stores_nothing(client, settings, length):
    response = client.post("/v1/files", files={"file": ("x" * length, b"{}\n")}, data={"purpose": "batch"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert "1024 characters" in response.json()["error"]["message"]
    assert [p.name for p in settings.files_dir.iterdir()] == []


def test_a_field_or_file_sent_twice_is_400_and_stores_nothing(client, settings):
    form = [("purpose", (None, b"batch")), ("purpose", (None, b"user_data")), ("file", ("a.jsonl", b"{}\n"))]
    files_twice = [("purpose", (None, b"batch")), ("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n"))]
    for parts, param in ((form, "purpose"), (files_twice, "file")):
        response = client.post("/v1/files", files=parts)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["message"]) == (param, f"The form sends '{param}' twice: send it once.")
    assert [p.name for p in settings.files_dir.iterdir()] == []


def test_a_form_without_a_file_part_or_with_junk_is_400(client, settings):
    boundary = "b0undary"
    junk = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}--\r\n'
    for content in (junk.encode(), b"not a multipart body at all"):
        response = client.post(
            "/v1/files", content=content, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "file"
    assert [p.name for p in settings.files_dir.iterdir()] == []
