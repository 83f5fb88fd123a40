"""What is checked before a request's body is read: its URL, its Host, its key, the size of a JSON body, and the
pace of any body.

FastAPI reads and parses a JSON body before it resolves dependencies, so a key checked as a dependency comes too
late: a stranger's 200 MB body would be read and parsed first. This guard answers 401 from the headers alone and
bounds a JSON body (413) before the route sees it. Uploads (multipart) are bounded by `app.api.uploads` as they
stream, after this key check. A body must keep coming: after `grace` seconds, at least `min_rate` bytes a
second on average, or the request ends with 408 and its connection is closed (what was stored of it is removed).

Without keys, the service trusts whoever reaches it, which a web page can do through DNS rebinding (its own name
resolving to 127.0.0.1 a moment later): the browser then sends that name as `Host`. So without keys only loopback
names, the address served on and `VBATCH_ALLOWED_HOSTS` are answered (the health probes answer any).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from urllib.parse import unquote_to_bytes

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import APIError, from_domain, request_too_large
from app.core.auth import KeyRing, is_loopback
from app.core.errors import Unauthenticated
from app.core.fleet import FLEET_HEADER, FleetKey
from app.domain.online import ONLINE_ENDPOINTS

HEALTH_PATHS = frozenset({"/health", "/health/ready", "/health/live"})
OPENAPI_PATH = "/openapi.json"
# Where a forwarded request's tenant is kept for `app.api.deps` (the request's state: nothing a client sends sets it).
FORWARDED_TENANT = "vbatch_fleet_tenant"


class SlowBody(Exception):
    pass


class HostRule:
    """The host names a request may name besides loopback ones (lower case, no port)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    @classmethod
    def of_service(cls, *, listed: str, served_on: str, keys: bool) -> HostRule | None:
        """None: any host (keys guard the service, or `*` is listed)."""
        names = {host_name(name) for name in listed.split(",") if name.strip()}
        if "*" in names or (keys and not names):
            return None
        served = host_name(served_on)
        if served and not _unspecified(served):
            names.add(served)
        return cls(frozenset(names))

    def allows(self, host: str | None) -> bool:
        # Only an HTTP/1.0 request can leave Host out, and no browser sends one.
        if host is None:
            return True
        name = host_name(host)
        return is_loopback(name) or name in self.names


def host_name(host: str) -> str:
    """A Host header's (or a setting's) name: 'Example.COM.:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") > 1:  # a bare IPv6 address, as a setting may give it
        return host
    return host.partition(":")[0].rstrip(".")


def _unspecified(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyRing,
        fleet: FleetKey | None = None,
        hosts: HostRule | None,
        max_json_bytes: int,
        body_grace: float,
        min_body_rate: int,
    ) -> None:
        self.app = app
        self.keys = keys
        self.fleet = fleet
        self.hosts = hosts
        self.max_json_bytes = max_json_bytes
        self.body_grace = body_grace
        self.min_body_rate = min_body_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._check(scope, self._paced(receive), send_watched)
        except SlowBody:
            if not started:
                error = APIError(408, "The request body arrived too slowly.", code="request_timeout")
                error.headers = {"connection": "close"}
                await _refuse(error, scope, receive, send)

    def _paced(self, receive: Receive) -> Receive:
        """`receive`, failing with SlowBody once the body is behind its pace; untouched after the body's end (a
        streaming response listens on it for the client going away)."""
        start = time.monotonic()
        received, done = 0, False

        async def paced() -> Message:
            nonlocal received, done
            if done:
                return await receive()
            left = start + self.body_grace + received / self.min_body_rate - time.monotonic()
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    message = await receive()
            except TimeoutError:
                raise SlowBody from None
            received += len(message.get("body", b""))
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return paced

    async def _check(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        forwarded = self._forwarded(scope, headers)
        refusal = self._refusal(scope, headers, keyless=forwarded is not None)
        if refusal is not None:
            await _refuse(refusal, scope, receive, send)
            return
        if scope["path"].startswith("/v1/") and headers.get("content-type", "").startswith("application/json"):
            body = await self._json_body(headers, receive)
            if body is None:
                await _refuse(self._too_large(), scope, receive, send)
                return
            if forwarded is not None and not self._take_tenant(scope, headers, forwarded, body):
                await _refuse(_NOT_FROM_THE_FLEET, scope, receive, send)
                return
            receive = _replay(body, receive)
        elif forwarded is not None:  # the fleet forwards JSON only: nothing else is signed
            await _refuse(_NOT_FROM_THE_FLEET, scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _forwarded(self, scope: Scope, headers: dict[str, str]) -> str | None:
        """The fleet's signature of an online request an API replica forwarded here (None: a client's own request,
        which its key authenticates). Only a worker, which has a fleet key, takes one."""
        if self.fleet is None or scope["method"] != "POST" or scope["path"] not in ONLINE_ENDPOINTS:
            return None
        return headers.get(FLEET_HEADER)

    def _take_tenant(self, scope: Scope, headers: dict[str, str], signature: str, body: bytes) -> bool:
        """Whether the signature holds for this body, path and request id; the tenant it names then answers for the
        request (`app.api.deps`)."""
        assert self.fleet is not None
        signed = self.fleet.check(signature, request_id=headers.get("x-request-id", ""), path=scope["path"], body=body)
        if signed is None:
            return False
        scope.setdefault("state", {})[FORWARDED_TENANT] = signed.tenant
        return True

    def _refusal(self, scope: Scope, headers: dict[str, str], *, keyless: bool = False) -> APIError | None:
        """Why the request is refused on its request line and headers alone, or None. `keyless`: a request the fleet
        forwarded, which carries no key (its signature is checked with its body)."""
        path = scope["path"]
        if not _utf8_url(scope):
            return APIError(400, "The request URL is not UTF-8 once its %-escapes are decoded.", code="invalid_url")
        if path in HEALTH_PATHS:
            return None
        if self.hosts is not None and not self.hosts.allows(headers.get("host")):
            return _host_refused(headers["host"])
        if (path.startswith("/v1/") or path == OPENAPI_PATH) and not keyless:
            try:
                self.keys.owner(headers.get("authorization"))
            except Unauthenticated as exc:
                return from_domain(exc)
        return None

    async def _json_body(self, headers: dict[str, str], receive: Receive) -> bytes | None:
        """The whole body, or None once it is known to pass the limit (declared or counted)."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_json_bytes:
            return None
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the route will see it too
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_json_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return request_too_large(self.max_json_bytes)


def _utf8_url(scope: Scope) -> bool:
    """Whether path and query are UTF-8 once unescaped: uvicorn decodes `%ff` to U+FFFD, a name no route knows."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    try:
        unquote_to_bytes(raw_path).decode()
        unquote_to_bytes(scope.get("query_string", b"")).decode()
    except UnicodeDecodeError:
        return False
    return True


_NOT_FROM_THE_FLEET = APIError(
    401,
    "This request names a tenant without a valid fleet signature (VBATCH_FLEET_SECRET differs, the clock is off, or "
    "it was not sent by an API replica of this fleet).",
    code="invalid_fleet_signature",
)


def _host_refused(host: str) -> APIError:
    return APIError(
        400,
        f"This service does not answer to the host {host[:100]!r}: only to loopback names, the address it serves "
        "on and the names in VBATCH_ALLOWED_HOSTS.",
        code="host_not_allowed",
    )


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the client's own messages: a route or a streaming answer that waits for the
    client to go away (an online request, to abort it in the engine) must hear of it when it happens, not at once."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
