"""Every byte vbatch keeps goes through here: in the data directory (`Storage`), or in an S3-compatible store with the
directory as scratch (`app.core.object_storage`). Names come from ids we generate, never from requests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import aiofiles
import aiofiles.os
from aiofiles.threadpool.binary import AsyncBufferedIOBase

from app.core.disk import DiskFull, DiskReserve, is_disk_full

CHUNK_BYTES = 1 << 20


class UploadTooLarge(Exception):
    pass


# Called at each checkpoint with the output and error part files' new lengths and the bytes just appended to reach
# them, once durable on the local disk and before the database commits them: an object store gets the new bytes as
# segments (`app.core.object_storage`).
ShipParts = Callable[[tuple[int, bytes], tuple[int, bytes]], Awaitable[None]]


async def no_bytes() -> AsyncIterator[bytes]:
    """An empty stream (a part or file with nothing in it yet)."""
    return
    yield  # pragma: no cover - makes this an async generator


class Storage:
    def __init__(self, root: Path, reserve: DiskReserve | None = None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.reserve = reserve or DiskReserve(root / ".reserve", size=0, keep_free=0)

    def path(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise ValueError(f"not a storage name: {name!r}")
        return self.root / name

    async def save_stream(
        self, name: str, chunks: AsyncIterator[bytes], *, max_bytes: int, keep_free: bool = False
    ) -> int:
        """Write to a temporary file, fsync, then rename: a crash never leaves a half file under `name`.

        DiskFull if the disk fills, or, with `keep_free`, if there is not room for it (`check_room`): the room
        left is for the results of running batches."""
        final = self.path(name)
        partial = final.with_name(f".{name}.upload")
        size = 0
        try:
            async with aiofiles.open(partial, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise UploadTooLarge(size)
                    if keep_free:
                        self.check_room(len(chunk))
                    await out.write(chunk)
                await out.flush()
                await asyncio.to_thread(os.fsync, out.fileno())  # up to the whole upload's bytes: seconds
            await aiofiles.os.replace(partial, final)
            await asyncio.to_thread(_fsync_dir, self.root)
        except BaseException as exc:
            await _remove(partial)
            if isinstance(exc, OSError) and is_disk_full(exc):
                self.reserve.release()
                raise DiskFull(str(exc)) from exc
            raise
        return size

    async def save_bytes(self, name: str, data: bytes) -> None:
        """All of `data` under `name`, durably and whole (the same temporary-file dance as an upload)."""

        async def once() -> AsyncIterator[bytes]:
            yield data

        await self.save_stream(name, once(), max_bytes=len(data))

    async def read_bytes(self, name: str) -> bytes:
        async with aiofiles.open(self.path(name), "rb") as src:
            return await src.read()

    async def read_chunks(self, name: str) -> AsyncIterator[bytes]:
        async with aiofiles.open(self.path(name), "rb") as src:
            while chunk := await src.read(CHUNK_BYTES):
                yield chunk

    async def open_prefix(self, name: str, length: int | None = None) -> tuple[AsyncIterator[bytes], int] | None:
        """The first `length` bytes (all if None) of a file, opened now so that a later rename or unlink cannot
        cut the stream short; None if there is no such file."""
        try:
            handle = await aiofiles.open(self.path(name), "rb")
        except FileNotFoundError:
            return None
        size = os.fstat(handle.fileno()).st_size
        size = size if length is None else min(size, length)

        async def chunks() -> AsyncIterator[bytes]:
            left = size
            try:
                while left > 0 and (chunk := await handle.read(min(CHUNK_BYTES, left))):
                    left -= len(chunk)
                    yield chunk
            finally:
                await handle.close()

        return chunks(), size

    def open_appender(self, name: str) -> ResultAppender:
        return ResultAppender(self.path(name))

    async def copy(self, existing: str, new: str) -> None:
        """A second name for the same bytes (replacing whatever had that name): a batch keeps its input whatever
        happens to the input's file object. Here a hard link: stored bytes never change."""
        await self._link(self.path(existing), new)

    async def store_part(self, part: Path, name: str) -> None:
        """A finished part file (in `root`) stored as `name`: the part stays until the database commits the file."""
        await self._link(part, name)

    async def _link(self, existing: Path, new: str) -> None:
        await _remove(self.path(new))
        await aiofiles.os.link(existing, self.path(new))
        await asyncio.to_thread(_fsync_dir, self.root)

    async def local_path(self, name: str) -> Path:
        """A path to read the stored bytes of `name` from (FileNotFoundError, when opened, if there are none)."""
        return self.path(name)

    async def begin_parts(
        self, previous: Sequence[str], lengths: Sequence[int], own: Sequence[Path]
    ) -> ShipParts | None:
        """Start a run's own part files from the first `lengths` bytes of the `previous` run's (its checkpoint's);
        what to call at each checkpoint, if anything, to keep them beyond this disk."""
        await asyncio.to_thread(adopt, [self.path(name) for name in previous], lengths, own)
        return None

    async def open_part(self, name: str, length: int) -> tuple[AsyncIterator[bytes], int] | None:
        """The first `length` bytes of a running batch's part file, as its last checkpoint committed them."""
        return await self.open_prefix(name, length)

    def names(self) -> list[str]:
        """Everything in the directory, temporary uploads included."""
        return [entry.name for entry in self.root.iterdir() if entry.is_file()]

    def age_seconds(self, name: str) -> float:
        """Since the raw directory entry `name` was last written (0 if it is gone)."""
        try:
            return time.time() - (self.root / name).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def remove_any(self, name: str) -> None:
        """Delete by raw directory entry name (used by the startup sweep for temporary files too)."""
        (self.root / name).unlink(missing_ok=True)

    async def size(self, name: str) -> int:
        return (await aiofiles.os.stat(self.path(name))).st_size

    async def delete(self, name: str) -> None:
        await _remove(self.path(name))

    async def delete_all(self, names: Sequence[str]) -> None:
        """Every one of `names` (a batch's run files as it ends), with their segments in an object store."""
        for name in names:
            await self.delete(name)

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    def has_room(self) -> bool:
        """What `check_room` says, as a yes or no."""
        try:
            self.check_room()
        except DiskFull:
            return False
        return True

    def check_room(self, size: int = 0) -> None:
        """DiskFull while the disk is full (its reserve released: what is left is the database's), or if `size`
        more bytes would leave less free than the reserve keeps."""
        free = self.free_bytes()
        if not self.reserve.held or free - size < self.reserve.keep_free:
            raise DiskFull(f"{free} bytes free")


def adopt(previous: Sequence[Path], lengths: Sequence[int], own: Sequence[Path]) -> None:
    """A run that took a batch over starts its own part files from what the previous run's checkpoint counts: the
    previous run may still be alive (stalled past its lease), and it must not write into the files this run keeps."""
    for old, length, new in zip(previous, lengths, own, strict=True):
        if old == new or new.exists() or not old.exists():
            continue
        partial = new.with_name(f".{new.name}.adopt")
        with old.open("rb") as src, partial.open("wb") as dst:
            left = length
            while left > 0 and (chunk := src.read(min(CHUNK_BYTES, left))):
                dst.write(chunk)
                left -= len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        partial.replace(new)


def keep_private(data_dir: Path) -> None:
    """Uploads, results and the database (which holds key digests) are the service's alone: everything vbatch
    creates from now on is owner-only, and what an older version left readable is made so."""
    os.umask(0o077)
    data_dir.mkdir(parents=True, exist_ok=True)
    for directory, _, names in os.walk(data_dir):
        os.chmod(directory, 0o700)
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode & 0o700)


async def _remove(path: Path) -> None:
    """Unlink off the loop (a large file's blocks are freed as it goes); shielded, so that a cancelled upload still
    leaves no partial file."""
    await asyncio.shield(asyncio.to_thread(path.unlink, missing_ok=True))


def _fsync_dir(directory: Path) -> None:
    """A rename or link is durable only once its directory is fsynced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ResultAppender:
    """Appends result lines; buffers them so that a line costs no system call of its own.

    `bytes` counts what reached the file; `take` + `write` let a checkpoint pair exactly those bytes with the
    counts that describe them.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._buffer: list[bytes] = []
        self.lines = 0
        self.bytes = 0
        self._file: AsyncBufferedIOBase | None = None

    async def open(self) -> None:
        self._file = await aiofiles.open(self.path, "ab")
        self.bytes = await self._file.tell()

    def add(self, line: bytes) -> None:
        self._buffer.append(line)
        self.lines += 1

    def add_lines(self, data: bytes) -> None:
        """Whole lines at once (a shard's result file joined into its parent's)."""
        self._buffer.append(data)
        self.lines += data.count(b"\n")

    def take(self) -> bytes:
        data = b"".join(self._buffer)
        self._buffer.clear()
        return data

    async def write(self, data: bytes, *, durable: bool = False) -> None:
        assert self._file is not None
        if data:
            await self._file.write(data)
            self.bytes += len(data)
        await self._file.flush()
        if durable:
            await asyncio.to_thread(os.fsync, self._file.fileno())

    async def flush(self, *, durable: bool = False) -> None:
        await self.write(self.take(), durable=durable)

    async def close(self) -> None:
        if self._file is not None:
            await self.flush(durable=True)
            await self._file.close()
            self._file = None

    async def abandon(self) -> None:
        """Close without writing what is buffered; a failing flush still closes the file."""
        self._buffer.clear()
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):
                await file.close()
