"""The S3 store (moto's server) under the storage API: create-only segments, committed chains, uploads that fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import obstore
import pytest

from app.core.object_storage import ObjectStorage, segment_name
from app.core.storage import UploadTooLarge


@pytest.fixture
def storage(s3, tmp_path) -> ObjectStorage:
    return ObjectStorage(s3.new_url(), tmp_path / "scratch")


def stored(storage: ObjectStorage) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(storage.store) for meta in batch)


async def _collect(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


def test_an_upload_that_fails_midway_leaves_nothing_in_the_store(storage):
    async def too_much() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"x" * (4 << 20)

    with pytest.raises(UploadTooLarge):
        asyncio.run(storage.save_stream("file-big", too_much(), max_bytes=10 << 20))
    assert stored(storage) == []
    assert not list(storage.root.iterdir())  # streamed: nothing was written to the local disk either

    async def fits() -> AsyncIterator[bytes]:
        yield b"a" * (9 << 20)
        yield b"b"

    assert asyncio.run(storage.save_stream("file-ok", fits(), max_bytes=10 << 20)) == (9 << 20) + 1
    assert asyncio.run(storage.size("file-ok")) == (9 << 20) + 1
    assert asyncio.run(storage.read_bytes("file-ok")) == b"a" * (9 << 20) + b"b"


def test_checkpoints_ship_segments_that_a_takeover_and_partial_output_read_up_to_the_commit(storage, tmp_path):
    first = [storage.path("batch_a.1.output.part"), storage.path("batch_a.1.error.part")]  # never written here
    ship = asyncio.run(storage.begin_parts(["batch_a.output.part", "batch_a.error.part"], (0, 0), first))
    asyncio.run(ship((4, b"one\n"), (0, b"")))
    asyncio.run(ship((8, b"two\n"), (0, b"")))
    asyncio.run(ship((14, b"three\n"), (0, b"")))  # shipped, but say its checkpoint never committed: 8 bytes count
    names = ["batch_a.1.output.part", "batch_a.1.error.part"]
    assert stored(storage) == [
        segment_name(names[0], 0, 4),
        segment_name(names[0], 4, 8),
        segment_name(names[0], 8, 14),
    ]
    chunks, size = asyncio.run(storage.open_part(names[0], 8))
    assert (asyncio.run(_collect(chunks)), size) == (b"one\ntwo\n", 8)

    # Another machine takes over at the commit: its own parts start from the committed bytes and ship whole once.
    other = ObjectStorage(storage.url, tmp_path / "other")
    own = [other.path("batch_a.2.output.part"), other.path("batch_a.2.error.part")]
    ship = asyncio.run(other.begin_parts(names, (8, 0), own))
    assert own[0].read_bytes() == b"one\ntwo\n" and not own[1].exists()
    with own[0].open("ab") as part:
        part.write(b"four\n")
    asyncio.run(ship((13, b"four\n"), (0, b"")))
    chunks, size = asyncio.run(other.open_part("batch_a.2.output.part", 13))
    assert asyncio.run(_collect(chunks)) == b"one\ntwo\nfour\n"
    assert asyncio.run(other.open_part("batch_a.2.output.part", 20)) is None  # not committed that far

    # A stalled first run shipping again cannot replace a segment: writes are create-only.
    with pytest.raises(obstore.exceptions.AlreadyExistsError):
        obstore.put(storage.store, segment_name(names[0], 0, 4), b"six\n", mode="create")

    asyncio.run(other.delete("batch_a.1.output.part"))
    asyncio.run(other.delete("batch_a.2.output.part"))
    assert stored(storage) == []


def test_publish_copy_and_local_copies(storage):
    part = storage.path("batch_b.1.output.part")
    part.write_bytes(b"line\n" * 1000)
    asyncio.run(storage.store_part(part, "file-out"))
    asyncio.run(storage.copy("file-out", "batch_b.input"))
    local = asyncio.run(storage.local_path("batch_b.input"))
    assert local.read_bytes() == b"line\n" * 1000
    assert storage.exists("file-out") and not storage.exists("file-none")
    asyncio.run(storage.delete("batch_b.input"))
    assert not local.exists() and not storage.exists("batch_b.input")
    with pytest.raises(FileNotFoundError):
        asyncio.run(storage.local_path("batch_b.input"))
    assert "file-out" in storage.names()
