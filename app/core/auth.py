"""API keys: who is calling. Keys are held only as SHA-256 digests and compared in constant time; a caller is
known by its owner id (a prefix of that digest), which is what files and batches record."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.errors import Unauthenticated

if TYPE_CHECKING:
    from app.core.webhooks import Endpoint

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
    may be followed on its line by its own webhook URL and secret, and by `name=value` settings of its own)."""
    keys = [k.strip() for k in inline.split(",")]
    for number, key in enumerate((k for k in keys if k), start=1):
        if not _sendable(key):
            raise ValueError(f"VBATCH_API_KEYS, key {number}: {_NOT_SENDABLE}")
    keys += [line.fields[0] for line in key_file_entries(path)]
    return [k for k in keys if k]


# An HTTP header carries a key: clients (httpx, the openai SDK) send ASCII only.
_NOT_SENDABLE = "a key must be printable ASCII, as an HTTP header carries it"


def _sendable(key: str) -> bool:
    return key.isascii() and key.isprintable()


# The settings a key may have on its line of the keys file, `name=value` after the key: its own limits on online
# requests a minute and tokens a minute (a whole number; 0: none), in place of VBATCH_LIVE_RPM and VBATCH_LIVE_TPM.
KEY_SETTINGS = ("live_rpm", "live_tpm")
# A setting is a lower-case name and `=`: no webhook URL (a scheme and `:` first) or whsec_ secret reads as one.
_SETTING = re.compile(r"([a-z][a-z_]*)=(.*)")


@dataclass(frozen=True)
class KeyLine:
    """One line of the keys file: the key and what follows it in order (a webhook URL and secret), then the key's
    own settings by name; `webhook`: the endpoint its URL and secret make, if it has them."""

    fields: list[str]
    settings: dict[str, int]
    webhook: Endpoint | None = None


def key_file_lines(path: Path | None) -> list[list[str]]:
    """The keys file's lines, split on whitespace, without comments, blank lines and the keys' `name=value`
    settings (`key_settings` reads those)."""
    return [line.fields for line in key_file_entries(path)]


def key_settings(path: Path | None) -> dict[str, dict[str, int]]:
    """Each key's own settings from the keys file, by its owner id (keys without any are left out)."""
    return {owner_of(line.fields[0]): line.settings for line in key_file_entries(path) if line.settings}


def key_file_entries(path: Path | None) -> list[KeyLine]:
    """The keys file read and checked; ValueError naming the line (never a word of it): a key that is not printable
    ASCII or that an earlier line has, a line of other than a key or a key, its webhook URL and its secret, a
    webhook URL or secret that is not one, a setting that is unknown, given twice or not a whole number of at least
    0."""
    if path is None:
        return []
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"VBATCH_API_KEYS_FILE {path} cannot be read: {exc.strerror}") from None
    entries = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            where = f"VBATCH_API_KEYS_FILE {path}, line {number}"
            entry = _key_line(line.split(), where)
            known = first_line.setdefault(digest(entry.fields[0]), number)
            if known != number:
                raise ValueError(f"{where}: its key is the key of line {known}; give each key one line")
            entries.append(entry)
    return entries


def _key_line(words: list[str], where: str) -> KeyLine:
    fields = words[:1]
    settings: dict[str, int] = {}
    for word in words[1:]:
        match = _SETTING.fullmatch(word)
        if match is None:
            fields.append(word)
            continue
        name, value = match.groups()
        if name not in KEY_SETTINGS:
            known = ", ".join(f"{known}=" for known in KEY_SETTINGS)
            raise ValueError(f"{where}: unknown setting {name}= (a key's line may set {known})")
        if name in settings:
            raise ValueError(f"{where}: {name}= is given twice")
        if not value.isascii() or not value.isdigit() or len(value) > 15:
            raise ValueError(f"{where}: {name}= takes a whole number a minute, 0 for no limit; not {value[:40]!r}")
        settings[name] = int(value)
    _check_shape(fields, where)
    return KeyLine(fields, settings, _webhook(fields, where))


def _check_shape(fields: list[str], where: str) -> None:
    if not _sendable(fields[0]):
        raise ValueError(f"{where}: {_NOT_SENDABLE}")
    if len(fields) not in (1, 3):
        raise ValueError(
            f"{where}: a line is a key, or a key, its webhook URL and its whsec_ secret, then its name=value "
            f"settings; this one has {len(fields)} words before its settings (a # comment takes a line of its own)"
        )


def _webhook(fields: list[str], where: str) -> Endpoint | None:
    """The endpoint a line's webhook URL and secret make (None: a key alone); ValueError naming the line for ones
    that make none."""
    if len(fields) != 3:
        return None
    from app.core.webhooks import Endpoint  # httpx and standardwebhooks: only for a file that names webhooks

    try:
        return Endpoint(fields[1], fields[2])
    except ValueError:
        raise ValueError(
            f"{where}: its webhook URL must be http(s)://host/... and its secret whsec_ and base64 after it"
        ) from None


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
