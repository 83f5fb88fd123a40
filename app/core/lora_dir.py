"""`VBATCH_LORA_DIR`: LoRA adapters found by name at first use, one folder per adapter (PEFT's layout:
`<name>/adapter_config.json` and its weights), in a local folder or under an `s3://bucket/prefix`, as vLLM's
filesystem resolver finds them in `VLLM_LORA_RESOLVER_CACHE_DIR`.

The engine loads an adapter from a local folder, so an adapter in an object store is copied once to a cache folder
of the data directory, at its first use; stored adapters are taken not to change under their name (a new version
gets a new name, as vLLM's prefix cache needs: it keys blocks by the adapter's name).

Every call here blocks (disk, object store): the callers run it on a thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.blocking import refuse_on_loop
from app.core.config import Settings

if TYPE_CHECKING:
    from obstore.store import ObjectStore

log = logging.getLogger("vbatch.engine")

S3_SCHEME = "s3://"
MAX_NAME_BYTES = 255


@dataclass(frozen=True)
class LoraDir:
    """Picklable (front-end processes get it): the object store is opened per copy, which is once an adapter."""

    url: str  # a local folder, or s3://bucket/prefix
    cache: Path  # where adapters from an object store are copied

    @property
    def remote(self) -> bool:
        return self.url.startswith(S3_SCHEME)

    def folder(self, name: str) -> Path | None:
        """The local folder of the adapter called `name`, copied from the object store if it is there and not yet
        here; None when there is no such folder (or `name` is not a folder's name: no path may climb out)."""
        if not _plain_name(name):
            return None
        if not self.remote:
            local = Path(self.url) / name
            return local if local.is_dir() else None
        cached = self.cache / name
        if cached.is_dir():
            return cached
        return self._copy(name, cached)

    def has(self, name: str) -> bool:
        """Whether there is an adapter folder called `name`, without copying it."""
        if not _plain_name(name):
            return False
        if not self.remote:
            return (Path(self.url) / name).is_dir()
        if (self.cache / name).is_dir():
            return True
        from obstore.store import from_url

        return bool(_objects(from_url(self.url), name))

    def _copy(self, name: str, cached: Path) -> Path | None:
        import obstore
        from obstore.store import from_url

        store = from_url(self.url)
        objects = _objects(store, name)
        if not objects:
            return None
        # Copied beside its place and renamed into it whole: a process that copies it at the same time, or one
        # killed halfway, never leaves a folder that looks complete and is not.
        partial = self.cache / f".{name}.{uuid.uuid4().hex}.download"
        try:
            for key, segments in objects.items():
                target = partial.joinpath(*segments)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(bytes(obstore.get(store, key).bytes()))
            try:
                os.rename(partial, cached)
            except OSError:
                if not cached.is_dir():  # else another process copied it first
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return cached


def _objects(store: ObjectStore, name: str) -> dict[str, list[str]]:
    """The keys of the adapter folder `name` in `store`, each with the path segments below the folder it is copied
    to; none (no such adapter) if a key has a segment no local folder can hold: S3 takes `..`, `.` and empty ones
    (`a//b`), and copied as they are they would write outside the cache (`partial / "/etc/x"` is /etc/x)."""
    import obstore
    from obstore.exceptions import InvalidPathError

    refuse_on_loop("obstore.list")
    try:
        keys = [meta["path"] for batch in obstore.list(store, prefix=f"{name}/") for meta in batch]
    except InvalidPathError as exc:  # obstore refuses to list such a key at all
        log.warning("VBATCH_LORA_DIR: the adapter folder %r holds a key no local folder can hold: %s", name, exc)
        return {}
    objects = {key: key.removeprefix(f"{name}/").split("/") for key in keys}
    unsafe = [key for key, segments in objects.items() if not all(_plain_name(part) for part in segments)]
    if unsafe:
        log.warning("VBATCH_LORA_DIR: the adapter folder %r holds a key no local folder can hold: %r", name, unsafe[0])
        return {}
    return objects


def _plain_name(name: str) -> bool:
    """A name that is one folder's, of a length file systems take (255 bytes)."""
    return (
        0 < len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        and name not in (".", "..")
        and not any(mark in name for mark in ("/", "\\", "\0"))
    )


def lora_dir(settings: Settings) -> LoraDir | None:
    """`VBATCH_LORA_DIR` as the service uses it (None: unset)."""
    url = settings.lora_dir
    if not url:
        return None
    return LoraDir(url=url.rstrip("/") if url.startswith(S3_SCHEME) else url, cache=settings.lora_cache_dir)
