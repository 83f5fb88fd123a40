"""API keys: who is calling. Keys are held only as SHA-256 digests and compared in constant time; a caller is
known by its owner id (a prefix of that digest), which is what files and batches record."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path

from app.core.errors import Unauthenticated

# Files and batches made while no keys are configured belong to nobody in particular.
ANONYMOUS = ""
_OWNER_HEX = 32

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
    "auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys(*, inline: str, path: Path | None) -> list[str]:
    """Keys from `VBATCH_API_KEYS` (comma-separated) and `VBATCH_API_KEYS_FILE` (one a line, `#` comments; a key
    may be followed on its line by its own webhook URL and secret)."""
    keys = [k.strip() for k in inline.split(",")]
    keys += [fields[0] for fields in key_file_lines(path)]
    return [k for k in keys if k]


def key_file_lines(path: Path | None) -> list[list[str]]:
    """The keys file's lines, split on whitespace, without comments and blank lines."""
    if path is None:
        return []
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"VBATCH_API_KEYS_FILE {path} cannot be read: {exc.strerror}") from None
    return [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def owner_of(key: str) -> str:
    return digest(key)[:_OWNER_HEX]


class KeyRing:
    def __init__(self, keys: list[str]) -> None:
        self._digests = tuple(sorted({digest(k) for k in keys}))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def has_owner(self, owner: str) -> bool:
        """Whether a configured key has this owner id (a console session outlives neither its key nor keys)."""
        if not self.enabled:
            return owner == ANONYMOUS
        return bool(owner) and any(known.startswith(owner) for known in self._digests)

    def owner(self, authorization: str | None) -> str:
        """The owner id for an `Authorization` header value; raises 401 for a missing or unknown key."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated(_MISSING)
        presented = digest(key)
        # Every digest is compared, so the time taken says nothing about which key came close.
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(known, presented)
        if not found:
            raise Unauthenticated(_WRONG, code="invalid_api_key")
        return owner_of(key)


def visible(row_owner: str, caller: str | None) -> bool:
    """Whether a caller sees a row; `None` is the engine itself, which sees everything."""
    return caller is None or row_owner == caller


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_binding_refusal(*, host: str, keys: int, insecure_no_auth: bool) -> str | None:
    """Why serving on `host` must not start, or None. Without keys anyone who reaches the port owns every batch,
    so only loopback is served unless the operator says, in so many words, that this is what they want."""
    if keys or is_loopback(host) or insecure_no_auth:
        return None
    return (
        f"refusing to serve on {host} without API keys: set VBATCH_API_KEYS or VBATCH_API_KEYS_FILE, "
        "or pass --insecure-no-auth if every client that can reach this port may read and run every batch"
    )
