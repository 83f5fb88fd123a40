"""A download racing a delete of the same file: the whole file or a 404, never a 200 cut short.

The deterministic tests put the delete at the two moments that matter (after the route found the file, and after
the 200's headers went out); the last one races real requests over a real socket."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from app.core.auth import ANONYMOUS
from app.domain import files
from app.main import create_app
from app.testing import free_port
from tests.helpers import serving, upload

pytestmark = pytest.mark.both_backends

# Over one storage chunk (1 MiB): the body takes more than one read.
CONTENT = os.urandom((1 << 20) + 4096)


@pytest.fixture
def deleting_after_headers(client, monkeypatch) -> list[str]:
    """From here on, when a file's content is about to start going out (the route's own response sends its 200's
    headers, below every middleware), that file is deleted first, as a DELETE landing just then would. Returns
    the ids it deleted."""
    state = client.app.state  # type: ignore[attr-defined]
    deleted: list[str] = []
    respond = StreamingResponse.__call__

    async def deleting_first(response: StreamingResponse, scope: Scope, receive: Receive, send: Send) -> None:
        file_id = scope["path"].split("/")[-2] if scope["path"].endswith("/content") else None

        async def deleting_send(message: Message) -> None:
            if file_id and message["type"] == "http.response.start" and message["status"] == 200:
                await files.delete(db=state.db, storage=state.storage, file_id=file_id, owner=ANONYMOUS)
                deleted.append(file_id)
            await send(message)

        await respond(response, scope, receive, deleting_send)

    monkeypatch.setattr(StreamingResponse, "__call__", deleting_first)
    return deleted


def test_a_delete_after_the_headers_went_out_leaves_the_body_whole(client, deleting_after_headers):
    file_id = upload(client, CONTENT, purpose="user_data", filename="blob.bin")["id"]
    response = client.get(f"/v1/files/{file_id}/content")
    assert deleting_after_headers == [file_id]  # the delete did happen, between the headers and the body
    assert response.status_code == 200
    assert response.headers["content-length"] == str(len(CONTENT))
    assert response.content == CONTENT
    assert client.get(f"/v1/files/{file_id}/content").status_code == 404


def test_a_delete_between_the_files_check_and_its_opening_is_a_404(client, monkeypatch):
    file_id = upload(client, CONTENT, purpose="user_data", filename="blob.bin")["id"]
    found = files.get
    storage = client.app.state.storage  # type: ignore[attr-defined]

    def found_then_deleted(*, db, file_id: str, owner: str | None):
        row = found(db=db, file_id=file_id, owner=owner)
        # On a thread of its own: the route may be running on the event loop, and this call is not awaited.
        with ThreadPoolExecutor(1) as thread:
            thread.submit(asyncio.run, files.delete(db=db, storage=storage, file_id=file_id, owner=owner)).result()
        return row

    monkeypatch.setattr(files, "get", found_then_deleted)
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 404, response.text
    assert response.json()["error"]["message"] == f"No such File object: {file_id}"
    monkeypatch.undo()
    assert client.get(f"/v1/files/{file_id}").status_code == 404  # the patched lookup did delete it


async def _race_once(http: httpx.AsyncClient, content: bytes) -> tuple[int, bytes]:
    created = await http.post("/v1/files", files={"file": ("blob.bin", content)}, data={"purpose": "user_data"})
    file_id = created.json()["id"]
    download, deleted = await asyncio.gather(
        http.get(f"/v1/files/{file_id}/content"), http.delete(f"/v1/files/{file_id}")
    )
    assert deleted.status_code == 200, deleted.text
    return download.status_code, download.content


def test_downloads_racing_deletes_over_a_socket_are_whole_or_404(settings, engine_service, backend):
    app = create_app(settings, engine_service)
    content = os.urandom(256 * 1024)
    rounds = 50 if backend == "sqlite" else 15

    async def race(port: int) -> list[tuple[int, bytes]]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            return [await _race_once(http, content) for _ in range(rounds)]

    with serving(app, free_port()) as port:
        answers = asyncio.run(race(port))
    for status, body in answers:
        assert (status, body) == (200, content) or (status == 404 and b"No such File object" in body), status
    assert len(answers) == rounds


def test_a_running_batchs_part_in_the_object_store_is_read_whole_once_opened(s3, tmp_path):
    """`partial_output` opens a running batch's part, then answers: a batch ending in between removes the part."""
    from app.core.object_storage import ObjectStorage

    storage = ObjectStorage(s3.new_url(), tmp_path / "scratch")
    own = [storage.path("batch_a.1.output.part"), storage.path("batch_a.1.error.part")]
    ship = asyncio.run(storage.begin_parts(["batch_a.output.part", "batch_a.error.part"], (0, 0), own))
    asyncio.run(ship((len(CONTENT), CONTENT), (0, b"")))

    async def open_delete_read() -> bytes:
        opened = await storage.open_part(own[0].name, len(CONTENT))
        assert opened is not None
        chunks, size = opened
        await storage.delete(own[0].name)
        assert size == len(CONTENT) and await storage.open_part(own[0].name, len(CONTENT)) is None
        return b"".join([chunk async for chunk in chunks])

    assert asyncio.run(open_delete_read()) == CONTENT
