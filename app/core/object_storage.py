"""Stored bytes in an S3-compatible object store (AWS S3, MinIO, Ceph, R2), through obstore.

obstore (Rust's `object_store`, the one Apache Arrow and DataFusion use) gives asyncio calls, multipart uploads
streamed from an async iterator, create-only puts and no Python dependencies; credentials, region and endpoint come
from the standard `AWS_*` environment variables, as every S3 tool reads them.

Objects cannot be appended to or cut back. A run appends its results to part files on its own disk (`root`, scratch
here), and at each checkpoint, before the database commits it, the bytes added since the last one go to the store
as a segment object `<part>/<start>-<end>`, created only if no object has that name: nothing replaces a committed
segment. A part's committed bytes are its segments from 0 up to the length its checkpoint counts; a run that takes
the batch over downloads them, `partial_output` streams them, and the finished part file is uploaded whole as the
output file (segments are usually under S3's 5 MiB minimum part, so a server-side multipart copy cannot join them).

Requests are counted (the fleet's limits, `docs/explanation/fleet-limits.md`): an upload no larger than a part is one
PUT, not a multipart upload's three; the segments a process shipped or downloaded are remembered, so a batch's run
files go at its end in one bulk delete, with one listing for the parts this process never saw.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiofiles

from app.core.blocking import refuse_on_loop
from app.core.disk import DiskReserve
from app.core.storage import CHUNK_BYTES, ShipParts, Storage, UploadTooLarge, no_bytes

try:
    import obstore
    from obstore.store import from_url
except ImportError as exc:  # pragma: no cover - the `s3` extra
    raise ImportError("VBATCH_STORAGE_URL=s3://... needs obstore: pip install 'vbatch[s3]'") from exc

# Multipart uploads (uploads, output files) go in parts this large; S3's smallest is 5 MiB.
UPLOAD_PART_BYTES = 8 << 20
_SEGMENT = re.compile(r"/(\d{16})-(\d{16})$")


def segment_name(part: str, start: int, end: int) -> str:
    return f"{part}/{start:016d}-{end:016d}"


class ObjectStorage(Storage):
    def __init__(self, url: str, scratch: Path, reserve: DiskReserve | None = None) -> None:
        if not url.startswith("s3://"):
            raise ValueError(f"VBATCH_STORAGE_URL must be s3://bucket[/prefix], not {url!r}")
        super().__init__(scratch, reserve)
        self.url = url
        self.store = from_url(url)
        # The segments of each part this process shipped or downloaded, until the part is deleted: all a part can
        # hold for its own run (a token is one claim's), all a later run adopted of an earlier one's.
        self._segments: dict[str, list[str]] = {}

    async def save_stream(
        self, name: str, chunks: AsyncIterator[bytes], *, max_bytes: int, keep_free: bool = False
    ) -> int:
        """Streamed to the store as a multipart upload, which the store discards if the stream fails (too large, or
        the client goes): nothing appears under `name` but a whole upload. `keep_free` is the local disk's concern."""
        self.path(name)  # the same names as on disk
        head, size = await _first_part(chunks, max_bytes)
        if size <= UPLOAD_PART_BYTES:  # all there is: one request
            await obstore.put_async(self.store, name, head)
            return size

        async def counted() -> AsyncIterator[bytes]:
            nonlocal size
            yield head
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise UploadTooLarge(size)
                yield chunk

        await obstore.put_async(self.store, name, counted(), chunk_size=UPLOAD_PART_BYTES)
        return size

    async def save_bytes(self, name: str, data: bytes) -> None:
        self.path(name)
        await obstore.put_async(self.store, name, data)

    async def read_bytes(self, name: str) -> bytes:
        result = await obstore.get_async(self.store, name)
        return bytes(await result.bytes_async())

    async def read_chunks(self, name: str) -> AsyncIterator[bytes]:
        result = await obstore.get_async(self.store, name)
        async for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
            yield bytes(chunk)

    async def open_prefix(self, name: str, length: int | None = None) -> tuple[AsyncIterator[bytes], int] | None:
        try:
            result = await obstore.get_async(self.store, name)
        except FileNotFoundError:
            return None
        size = result.meta["size"] if length is None else min(result.meta["size"], length)

        async def chunks() -> AsyncIterator[bytes]:
            left = size
            async for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
                if left <= 0:
                    break
                piece = bytes(chunk)[:left]
                left -= len(piece)
                yield piece

        return chunks(), size

    async def copy(self, existing: str, new: str) -> None:
        await obstore.copy_async(self.store, existing, new)

    async def store_part(self, part: Path, name: str) -> None:
        await obstore.put_async(self.store, name, part, chunk_size=UPLOAD_PART_BYTES)

    async def local_path(self, name: str) -> Path:
        """A copy on the local disk, downloaded once: stored bytes never change under their name."""
        path = self.path(name)
        if path.exists():
            return path
        result = await obstore.get_async(self.store, name)
        partial = path.with_name(f".{name}.download")
        async with aiofiles.open(partial, "wb") as out:
            async for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
                await out.write(chunk)
        partial.replace(path)
        return path

    async def begin_parts(self, previous: Sequence[str], lengths: Sequence[int], own: Sequence[Path]) -> ShipParts:
        """Own part files begun from the previous run's committed segments (unless this run began them already), and
        a shipper that sends what each checkpoint adds. Under a new name the whole file is shipped again once:
        segments belong to one part, and so to one lease."""
        shipped = []
        for name, length, path in zip(previous, lengths, own, strict=True):
            if not path.exists() and length > 0:
                await self._download_part(name, length, path)
            shipped.append(length if path.name == name else 0)
        return self._shipper(own, shipped)

    def _shipper(self, own: Sequence[Path], shipped: list[int]) -> ShipParts:
        for path in own:
            self._segments.setdefault(path.name, [])

        async def ship(*appended: tuple[int, bytes]) -> None:
            for i, (end, data) in enumerate(appended):
                start = end - len(data)
                if start > shipped[i]:  # the part's beginning, adopted from a previous run's
                    data = await asyncio.to_thread(_read_range, own[i], shipped[i], start) + data
                if end > shipped[i]:
                    segment = segment_name(own[i].name, shipped[i], end)
                    self._segments.setdefault(own[i].name, []).append(segment)
                    await obstore.put_async(self.store, segment, data, mode="create")
                    shipped[i] = end

        return ship

    async def _download_part(self, name: str, length: int, path: Path) -> None:
        segments = await asyncio.to_thread(self._committed, name, length)
        if segments is None:
            raise FileNotFoundError(f"the committed segments of {name} up to {length} bytes are not in the store")
        self._segments.setdefault(name, []).extend(segments)
        partial = path.with_name(f".{path.name}.adopt")
        async with aiofiles.open(partial, "wb") as out:
            for segment in segments:
                await out.write(await self.read_bytes(segment))
        partial.replace(path)

    async def open_part(self, name: str, length: int) -> tuple[AsyncIterator[bytes], int] | None:
        if length == 0:
            return no_bytes(), 0
        segments = await asyncio.to_thread(self._committed, name, length)
        if segments is None:
            return None
        try:  # under way before anyone answers with it, as `open_prefix`: a part removed by now is None, not 0 bytes
            first = await obstore.get_async(self.store, segments[0])
        except FileNotFoundError:
            return None

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in first.stream(min_chunk_size=CHUNK_BYTES):
                yield bytes(chunk)
            for segment in segments[1:]:
                async for chunk in self.read_chunks(segment):
                    yield chunk

        return chunks(), length

    def _committed(self, part: str, length: int) -> list[str] | None:
        """The segments of `part` that hold its bytes 0..length, in order (None if they do not reach it). A run that
        shipped segments its checkpoint then failed to commit left others beside them: only a chain counts."""
        refuse_on_loop("obstore.list")
        ends: dict[int, list[int]] = {}
        for batch in obstore.list(self.store, prefix=part):
            for meta in batch:
                match = _SEGMENT.search(meta["path"])
                if match:
                    ends.setdefault(int(match[1]), []).append(int(match[2]))
        chain = _chain(ends, length)
        return None if chain is None else [segment_name(part, start, end) for start, end in chain]

    def names(self) -> list[str]:
        refuse_on_loop("obstore.list")
        stored = [meta["path"] for batch in obstore.list(self.store) for meta in batch]
        return sorted(set(stored) | set(super().names()))

    def age_seconds(self, name: str) -> float:
        if "/" not in name and (self.root / name).exists():
            return super().age_seconds(name)
        refuse_on_loop("obstore.head")
        try:
            return time.time() - obstore.head(self.store, name)["last_modified"].timestamp()
        except FileNotFoundError:
            return 0.0

    def remove_any(self, name: str) -> None:
        refuse_on_loop("obstore.delete")
        if "/" not in name:  # a segment is only in the store
            super().remove_any(name)
        obstore.delete(self.store, name)

    async def size(self, name: str) -> int:
        return (await obstore.head_async(self.store, name))["size"]

    async def delete(self, name: str) -> None:
        """The object, its local copy, and, for a part, its segments."""
        self._segments.pop(name, None)
        await super().delete(name)
        await obstore.delete_async(self.store, name)
        if name.endswith(".part"):
            segments = [meta["path"] for meta in await obstore.list(self.store, prefix=name).collect_async()]
            if segments:
                await obstore.delete_async(self.store, segments)

    async def delete_all(self, names: Sequence[str]) -> None:
        """Their local copies, then the objects and the parts' segments in one bulk delete (as many as a request
        takes); the parts this process never shipped nor downloaded (an earlier lease's) are found by one listing
        under the prefix they share (a batch's id), not one listing each."""
        stored = []
        unknown = []
        for name in names:
            await super().delete(name)
            stored.append(name)
            if name.endswith(".part"):
                known = self._segments.pop(name, None)
                if known is None:
                    unknown.append(name)
                else:
                    stored.extend(known)
        if unknown:
            stored.extend(await self._segments_of(unknown))
        await obstore.delete_async(self.store, stored)

    async def _segments_of(self, parts: Sequence[str]) -> list[str]:
        """The segments of `parts` (of one batch) in the store, from one listing: a list's prefix is a path's
        (`a/` of `a/b`), not a name's, so it starts after the name the parts share and stops past it."""
        shared = os.path.commonprefix(list(parts))  # noqa: RUF071 - names, not paths: the characters they share
        found: list[str] = []
        async for page in obstore.list(self.store, offset=shared, chunk_size=1000):
            found.extend(meta["path"] for meta in page)
            if not found or not found[-1].startswith(shared):
                break
        return [path for path in found if "/" in path and path.partition("/")[0] in parts]

    def exists(self, name: str) -> bool:
        refuse_on_loop("obstore.head")
        try:
            obstore.head(self.store, name)
        except FileNotFoundError:
            return False
        return True


async def _first_part(chunks: AsyncIterator[bytes], max_bytes: int) -> tuple[bytes, int]:
    """The stream's first bytes, up to a part's and a chunk beyond (or all of it, if it ends first), and their size;
    UploadTooLarge past `max_bytes`."""
    head = bytearray()
    while len(head) <= UPLOAD_PART_BYTES:
        chunk = await anext(chunks, None)
        if chunk is None:
            break
        head += chunk
        if len(head) > max_bytes:
            raise UploadTooLarge(len(head))
    return bytes(head), len(head)


def _chain(ends: dict[int, list[int]], length: int) -> list[tuple[int, int]] | None:
    """Segments from 0 that end exactly at `length` (each offset reached once: a long batch has thousands)."""
    came_from: dict[int, int] = {}
    todo = [0]
    while todo:
        start = todo.pop()
        for end in ends.get(start, ()):
            if end <= length and end not in came_from:
                came_from[end] = start
                todo.append(end)
    if length not in came_from:
        return None
    chain = []
    end = length
    while end != 0:
        chain.append((came_from[end], end))
        end = came_from[end]
    return chain[::-1]


def _read_range(path: Path, start: int, end: int) -> bytes:
    with path.open("rb") as part:
        part.seek(start)
        return part.read(end - start)
