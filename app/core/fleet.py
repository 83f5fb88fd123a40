"""The fleet's own links: `vbatch api` replicas and `vbatch worker`s prove themselves to each other with a secret they
share (`VBATCH_FLEET_SECRET`), so that nobody who can write the database, or reach a worker's port, is taken for one.

- A worker's beat carries a proof of where it answers (`worker_proof`: an HMAC of its name and URL). A replica
  forwards online requests only to workers whose proof holds, so a `workers` row written by hand (pointing at a
  listener of its writer's) is never sent a caller's prompt.
- A forwarded request carries no caller key: the replica checked the key and names the caller's tenant (the key's
  owner id) in `FLEET_HEADER`, signed with the time, the request's id, its path and a digest of its body as sent. A
  worker takes that tenant only from a signature that holds and is recent; a captured header cannot be reused for
  another body, another path, or after `MAX_AGE_SECONDS`.

Each use has its own key derived from the secret, so a proof of one kind can never pass for the other.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

FLEET_HEADER = "x-vbatch-fleet"
# How old a signed request may be when a worker checks it: clocks of one fleet agree to well within this.
MAX_AGE_SECONDS = 300
# Short secrets are guessable from a captured signature; 32 bytes of `openssl rand -hex 32` is the advice.
MIN_SECRET_BYTES = 16
_SIGNED = re.compile(r"v1;t=(\d{1,12});tenant=([0-9a-f]{0,64});sig=([0-9a-f]{64})")


class FleetSecretMissing(ValueError):
    """`vbatch api` and `vbatch worker` start only with a fleet secret."""


@dataclass(frozen=True)
class Signed:
    """What a valid `FLEET_HEADER` says: the caller's tenant, as the replica that checked its key named it."""

    tenant: str


class FleetKey:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"VBATCH_FLEET_SECRET must be at least {MIN_SECRET_BYTES} bytes (openssl rand -hex 32)")
        self._workers = hmac.new(secret, b"vbatch worker proof", hashlib.sha256).digest()
        self._requests = hmac.new(secret, b"vbatch forwarded request", hashlib.sha256).digest()

    @classmethod
    def from_settings(cls, secret: str | None, secret_file: Path | None) -> FleetKey | None:
        """The key of `VBATCH_FLEET_SECRET`, or of the first line of `VBATCH_FLEET_SECRET_FILE`; None when neither."""
        if secret_file is not None:
            try:
                secret = secret_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"VBATCH_FLEET_SECRET_FILE {secret_file} cannot be read: {exc.strerror}") from None
        return cls(secret.encode()) if secret else None

    def worker_proof(self, holder: str, url: str) -> str:
        return _mac(self._workers, holder, url)

    def proves(self, holder: str, url: str, proof: str | None) -> bool:
        return proof is not None and hmac.compare_digest(self.worker_proof(holder, url), proof)

    def sign(self, *, tenant: str, request_id: str, path: str, body: bytes, now: float | None = None) -> str:
        """`FLEET_HEADER`'s value for a request forwarded on behalf of `tenant`."""
        at = str(int(time.time() if now is None else now))
        return f"v1;t={at};tenant={tenant};sig={self._request_mac(at, tenant, request_id, path, body)}"

    def check(self, header: str, *, request_id: str, path: str, body: bytes, now: float | None = None) -> Signed | None:
        """The tenant a forwarded request's header names, or None unless its signature holds and is recent."""
        match = _SIGNED.fullmatch(header)
        if match is None:
            return None
        at, tenant, signature = match.groups()
        age = (time.time() if now is None else now) - int(at)
        if not -MAX_AGE_SECONDS <= age <= MAX_AGE_SECONDS:
            return None
        if not hmac.compare_digest(self._request_mac(at, tenant, request_id, path, body), signature):
            return None
        return Signed(tenant)

    def _request_mac(self, at: str, tenant: str, request_id: str, path: str, body: bytes) -> str:
        return _mac(self._requests, at, tenant, request_id, path, hashlib.sha256(body).hexdigest())


def _mac(key: bytes, *fields: str) -> str:
    # Fields joined by a byte none of them holds (a NUL), so that no two lists of fields sign alike.
    message = "\0".join(fields).encode("utf-8", "surrogatepass")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class Networks:
    """`VBATCH_FLEET_NETWORKS`: where workers may answer, as networks (CIDR) and host names; empty allows any."""

    def __init__(self, listed: str) -> None:
        entries = [entry.strip().lower() for entry in listed.split(",") if entry.strip()]
        self._networks = []
        self._names = set()
        for entry in entries:
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._names.add(entry.rstrip("."))

    def allows(self, url: str) -> bool:
        if not self._networks and not self._names:
            return True
        host = (urlsplit(url).hostname or "").rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host in self._names
        return any(address in network for network in self._networks)
