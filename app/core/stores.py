"""Which store holds vbatch's bytes: the data directory (`app.core.storage`) or an S3-compatible store
(`app.core.object_storage`, a `Storage` itself). The choice sits above both, so the local store never imports the
object store built on it; the object store is imported only when a URL names one (obstore is the `s3` extra)."""

from __future__ import annotations

from pathlib import Path

from app.core.disk import DiskReserve
from app.core.storage import Storage


def open_storage(url: str | None, root: Path, reserve: DiskReserve | None = None) -> Storage:
    """The data directory's files (`url` None), or the S3-compatible store at `url` with `root` as scratch."""
    if url is None:
        return Storage(root, reserve)
    from app.core.object_storage import ObjectStorage

    return ObjectStorage(url, root, reserve)
