"""What is checked before a request's body is read: its key, the size of a JSON body, and the pace of any body.

FastAPI reads and parses a JSON body before it resolves dependencies, so a key checked as a dependency comes too
late: a stranger's 200 MB body would be read and parsed first. This guard answers 401 from the headers alone and
bounds a JSON body (413) before the route sees it. Uploads (multipart) are bounded by `app.api.uploads` as they
stream, after this key check. A body must keep coming: after `grace` seconds, at least `min_rate` bytes a
second on average, or the request ends with 408 and its connection is closed (what was stored of it is removed).
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import APIError, from_domain
from app.core.auth import KeyRing
from app.domain.errors import Unauthenticated


class SlowBody(Exception):
    pass


class RequestGuard:
    def __init__(
        self, app: ASGIApp, *, keys: KeyRing, max_json_bytes: int, body_grace: float, min_body_rate: int
    ) -> None:
        self.app = app
        self.keys = keys
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
        if not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            self.keys.owner(headers.get("authorization"))
        except Unauthenticated as exc:
            await _refuse(from_domain(exc), scope, receive, send)
            return
        if headers.get("content-type", "").startswith("application/json"):
            body = await self._json_body(headers, receive)
            if body is None:
                await _refuse(self._too_large(), scope, receive, send)
                return
            receive = _replay(body)
        await self.app(scope, receive, send)

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
        return APIError(
            413,
            f"The request body is too large: JSON bodies are at most {self.max_json_bytes} bytes.",
            code="request_too_large",
        )


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)(scope, receive, send)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive
