"""Requests that used to get a 500 or be half-accepted, and the data directory's permissions."""

from __future__ import annotations

import json
import stat

from tests.helpers import create_batch, jsonl, request_line, upload

BOUNDARY = "vbatch-cut-boundary"


def multipart(parts: list[tuple[str, str | None, bytes]], *, close: bool = True, boundary: str = BOUNDARY) -> bytes:
    body = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return body + (f"--{boundary}--\r\n".encode() if close else b"")


def post_form(client, body: bytes, boundary: str = BOUNDARY):
    return client.post("/v1/files", content=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})


def test_a_multipart_body_cut_short_is_400_and_stores_nothing(client, settings):
    content = jsonl([request_line(f"r{i}") for i in range(10)])
    whole = multipart([("purpose", None, b"batch"), ("file", "in.jsonl", content)])
    assert post_form(client, whole).status_code == 200  # the same form, whole, is fine
    cut = multipart([("purpose", None, b"batch"), ("file", "in.jsonl", content)], close=False)
    cut = cut[: len(cut) - len(content) // 2]  # the client gave up mid-file
    response = post_form(client, cut)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file"
    assert len(client.get("/v1/files").json()["data"]) == 1
    assert len(list(settings.files_dir.iterdir())) == 1


def test_an_overlong_boundary_is_400(client):
    boundary = "b" * 300
    response = post_form(client, multipart([("purpose", None, b"batch")], boundary=boundary), boundary=boundary)
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


def lone_surrogate_body(**fields) -> bytes:
    body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
    # json.dumps writes a lone surrogate as the escape \udc00, which JSON allows and Python reads back.
    return json.dumps(body).encode()


def test_lone_surrogates_are_refused_before_anything_is_stored(client):
    file_id = upload(client, jsonl([request_line("a")]))["id"]
    for fields, param in [
        ({"input_file_id": file_id, "metadata": {"k": "\udc00"}}, "metadata.k"),
        ({"input_file_id": file_id, "metadata": {"\udc00": "v"}}, "metadata"),
        ({"input_file_id": "file-\udc00"}, "input_file_id"),
    ]:
        response = client.post(
            "/v1/batches", content=lone_surrogate_body(**fields), headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == "invalid_value"
    assert client.get("/v1/batches").status_code == 200
    assert client.get("/v1/batches").json()["data"] == []
    create_batch(client, file_id, metadata={"k": "ok"})  # the service goes on


def test_the_data_directory_is_the_services_alone(client, settings):
    batch = create_batch(client, upload(client, jsonl([request_line("a")]))["id"])
    assert batch["id"]
    for path in [settings.data_dir, settings.files_dir, *settings.files_dir.iterdir(), settings.database_path]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
