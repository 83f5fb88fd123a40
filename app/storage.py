"""Every byte vbatch keeps on disk goes through here. Paths come from ids we generate, never from requests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiofiles
import aiofiles.os
from aiofiles.threadpool.binary import AsyncBufferedIOBase

CHUNK_BYTES = 1 << 20


class UploadTooLarge(Exception):
    pass


class Storage:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise ValueError(f"not a storage name: {name!r}")
        return self.root / name

    async def save_stream(self, name: str, chunks: AsyncIterator[bytes], *, max_bytes: int) -> int:
        """Write to a temporary file, fsync, then rename: a crash never leaves a half file under `name`."""
        final = self.path(name)
        partial = final.with_name(f".{name}.upload")
        size = 0
        try:
            async with aiofiles.open(partial, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise UploadTooLarge(size)
                    await out.write(chunk)
                await out.flush()
                os.fsync(out.fileno())
            await aiofiles.os.replace(partial, final)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return size

    async def read_chunks(self, name: str) -> AsyncIterator[bytes]:
        async with aiofiles.open(self.path(name), "rb") as src:
            while chunk := await src.read(CHUNK_BYTES):
                yield chunk

    def open_appender(self, name: str) -> ResultAppender:
        return ResultAppender(self.path(name))

    async def rename(self, old: str, new: str) -> None:
        await aiofiles.os.replace(self.path(old), self.path(new))

    async def size(self, name: str) -> int:
        return (await aiofiles.os.stat(self.path(name))).st_size

    async def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def exists(self, name: str) -> bool:
        return self.path(name).exists()


class ResultAppender:
    """Appends result lines; buffers them so that a line costs no system call of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._buffer: list[bytes] = []
        self.lines = 0
        self._file: AsyncBufferedIOBase | None = None

    async def open(self) -> None:
        self._file = await aiofiles.open(self.path, "ab")

    def add(self, line: bytes) -> None:
        self._buffer.append(line)
        self.lines += 1

    async def flush(self, *, durable: bool = False) -> None:
        assert self._file is not None
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            await self._file.write(data)
        await self._file.flush()
        if durable:
            os.fsync(self._file.fileno())

    async def close(self) -> None:
        if self._file is not None:
            await self.flush(durable=True)
            await self._file.close()
            self._file = None
