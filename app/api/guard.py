"""What is checked before a request's body is read: its key, and the size of a JSON body.

FastAPI reads and parses a JSON body before it resolves dependencies, so a key checked as a dependency comes too
late: a stranger's 200 MB body would be read and parsed first. This guard answers 401 from the headers alone and
bounds a JSON body (413) before the route sees it. Uploads (multipart) are bounded by `app.api.uploads` as they
stream, after this key check.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import APIError, from_domain
from app.core.auth import KeyRing
from app.domain.errors import Unauthenticated


class RequestGuard:
    def __init__(self, app: ASGIApp, *, keys: KeyRing, max_json_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_json_bytes = max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
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
