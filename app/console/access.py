"""Who is using the console: the session behind each request, the login redirect, and the CSRF check.

Pages need a session; without keys configured one is issued on the first visit (the service then serves loopback
only, as the API does). With keys, a visitor without a session is sent to the login page. Every request that
changes something must carry the session's CSRF token and, where the browser sends one, an `Origin` of this host.
A session that logged out is refused at once, in every process that shares the database.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote, urlsplit

from fastapi import Depends, Request

from app.console import sessions
from app.console.sessions import COOKIE, LIFETIME_SECONDS, Session, SessionSigner
from app.core.auth import ANONYMOUS, KeyRing

CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
# Fragments and JSON fetched by console.js say so; they get a status, not a redirect to the login page.
SCRIPT_HEADER = "x-requested-with"
SCRIPT_VALUE = "vbatch-console"


class LoginRequired(Exception):
    """No valid session: a page goes to the login page (or, without keys, gets a session and comes back)."""


class Forbidden(Exception):
    """A change without a valid CSRF token, or from another origin."""


def signer_of(request: Request) -> SessionSigner:
    return request.app.state.console_signer


def keys_of(request: Request) -> KeyRing:
    return request.app.state.keys


def _session(request: Request) -> Session:
    session = signer_of(request).read(request.cookies.get(COOKIE))
    if session is None or not keys_of(request).has_owner(session.owner):
        raise LoginRequired
    if sessions.ended(db=request.app.state.db, session=session):
        raise LoginRequired
    return session


def check_origin(request: Request) -> None:
    """A browser names the page a POST comes from; one from another site is refused (no token is needed for it)."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise Forbidden


async def _changing(request: Request, session: Annotated[Session, Depends(_session)]) -> Session:
    check_origin(request)
    token = request.headers.get(CSRF_HEADER)
    if token is None and request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        form = await request.form()
        value = form.get(CSRF_FIELD)
        token = value if isinstance(value, str) else None
    if not signer_of(request).csrf_ok(session, token):
        raise Forbidden
    return session


# A page or fragment: the caller's session.
SessionDep = Annotated[Session, Depends(_session)]
# A change (POST): the caller's session, its CSRF token checked.
ChangeDep = Annotated[Session, Depends(_changing)]


def anonymous_allowed(request: Request) -> bool:
    return not keys_of(request).enabled


def login_url(request: Request) -> str:
    return f"/console/login?next={quote(safe_next(request.url.path))}"


def safe_next(path: str | None) -> str:
    """Where to go after logging in: a console page of this host, never another site."""
    if path and path.startswith("/console/") and not path.startswith("//") and "\\" not in path:
        return path
    return "/console/batches"


def from_script(request: Request) -> bool:
    return request.headers.get(SCRIPT_HEADER) == SCRIPT_VALUE


def cookie_secure(request: Request) -> bool:
    """`VBATCH_COOKIE_SECURE`; `auto` follows the scheme the request came by, which behind a TLS proxy is https
    only where uvicorn trusts the proxy's X-Forwarded-Proto (`FORWARDED_ALLOW_IPS`, loopback by default)."""
    setting = request.app.state.settings.cookie_secure
    return request.url.scheme == "https" if setting == "auto" else setting == "true"


def cookie_attributes(request: Request) -> dict:
    """The session cookie's attributes: setting and deleting it must name the same ones."""
    return {"key": COOKIE, "httponly": True, "samesite": "strict", "secure": cookie_secure(request), "path": "/console"}


def new_session_cookie(request: Request, owner: str = ANONYMOUS) -> dict:
    """The `set_cookie` arguments of a new session for `owner`."""
    _, value = signer_of(request).issue(owner)
    return cookie_attributes(request) | {"value": value, "max_age": LIFETIME_SECONDS}
