"""Console sessions: a signed, httpOnly cookie that names an owner id, never a key, and a CSRF token bound to it.

The cookie carries `owner.issued.nonce` and an HMAC of them under a secret kept in the data directory (so sessions
outlive a restart and every worker agrees). A key that is removed from the configuration ends its sessions: each
request checks that some configured key still has the cookie's owner id. The CSRF token is an HMAC of the
session's nonce, sent back in each form (or the `X-CSRF-Token` header) that changes something.

Logging out ends a session before its cookie expires: its nonce is kept in the database (`EndedConsoleSession`)
until then, and every process that shares the database refuses it. Cookies and tokens come from strangers: reading
them never raises, whatever their bytes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import col

from app.core.db import lock_name, session_scope, write_scope
from app.domain.models import EndedConsoleSession

COOKIE = "vbatch_console"
LIFETIME_SECONDS = 12 * 3600
SECRET_FILE = "console-secret"


@dataclass(frozen=True)
class Session:
    owner: str
    issued: int
    nonce: str


def load_secret(data_dir: Path) -> bytes:
    """The signing secret, made once per data directory (0600)."""
    path = data_dir / SECRET_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(descriptor, "wb") as out:
        secret = secrets.token_bytes(32)
        out.write(secret)
    return secret


class SessionSigner:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def issue(self, owner: str) -> tuple[Session, str]:
        """A new session for `owner` and its cookie value."""
        session = Session(owner=owner, issued=int(time.time()), nonce=secrets.token_urlsafe(16))
        payload = f"{session.owner}.{session.issued}.{session.nonce}"
        encoded = base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")
        return session, f"{encoded}.{self._sign(payload)}"

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie holds, or None for a missing, forged or stale one."""
        if not isinstance(cookie, str) or cookie.count(".") != 1:
            return None
        encoded, signature = cookie.split(".")
        try:
            # Non-ASCII base64, bytes that are not UTF-8 and over-long numbers are all ValueErrors.
            payload = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            owner, issued, nonce = payload.split(".")
            issued_at = int(issued)
        except ValueError:
            return None
        if not _same(signature, self._sign(payload)):
            return None
        if not 0 <= time.time() - issued_at <= LIFETIME_SECONDS:
            return None
        return Session(owner=owner, issued=issued_at, nonce=nonce)

    def csrf_token(self, session: Session) -> str:
        return self._sign(f"csrf.{session.nonce}")

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return isinstance(token, str) and _same(token, self.csrf_token(session))

    def _sign(self, text: str) -> str:
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    """Constant-time equality for any text: `hmac.compare_digest` raises TypeError on non-ASCII str, and a header
    or cookie decoded as Latin-1 (or a form field with a lone surrogate) is such a str."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def end(*, db: Engine, session: Session) -> None:
    """Log `session` out in every process that shares `db`, until its cookie would have expired anyway. Entries
    past that are pruned here, so the table holds at most twelve hours of logouts."""
    now = int(time.time())
    with write_scope(db) as transaction:
        lock_name(transaction, f"console-session:{session.nonce}")
        transaction.exec(delete(EndedConsoleSession).where(col(EndedConsoleSession.expires_at) < now))  # type: ignore[call-overload]
        if transaction.get(EndedConsoleSession, session.nonce) is None:
            transaction.add(EndedConsoleSession(nonce=session.nonce, expires_at=session.issued + LIFETIME_SECONDS))
        transaction.commit()


def ended(*, db: Engine, session: Session) -> bool:
    """Whether `session` was logged out."""
    with session_scope(db) as transaction:
        return transaction.get(EndedConsoleSession, session.nonce) is not None
