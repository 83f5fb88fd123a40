"""A stand-in for a worker's online routes, on a real socket: what `vbatch api` forwards to, in the tests of the
forwarding (`tests/integration/test_forward.py`), without an engine. `python -m tests.standin_worker --port P
--name N` runs it in a process of its own, for a test to kill or freeze.

A body with `stream: true` gets `STREAM`, in pieces cut across its events' boundaries (`hold: true`: its first
event and half the next, then nothing until the client leaves; `cut: true`: the same, then the connection is
dropped); a body with `cut: true` alone gets a JSON answer cut off midway;
`status: N` that status with vLLM's error body; any other body a JSON echo of what the worker was sent (its body
parsed and as sent, and the headers that say who sent it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.core.fleet import FLEET_HEADER
from app.domain.online import ONLINE_ENDPOINTS


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


EVENTS = [
    sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}}]})
    for word in ("Hello", ",", " wörld", "!")
] + [sse("[DONE]")]
STREAM = b"".join(EVENTS)
# Cut inside events, and one piece holding the end of one event and the start of the next.
PIECES = [STREAM[:7], STREAM[7:150], STREAM[150:151], STREAM[151:]]


class _EchoJSON(JSONResponse):
    """An echo of what was sent, NaN and lone surrogates too (as vLLM's own answers echo them)."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, allow_nan=True).encode()


class Standin:
    def __init__(self, name: str) -> None:
        self.name = name
        self.left: queue.Queue[int] = queue.Queue()  # one item for each held stream whose client went away
        self.requests: list[dict] = []
        self.app = Starlette(routes=[Route(path, self.answer, methods=["POST"]) for path in ONLINE_ENDPOINTS])

    async def answer(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if body.get("stream"):
            events = self._held() if body.get("hold") else _cut_stream() if body.get("cut") else _pieces()
            return StreamingResponse(events, media_type="text/event-stream")
        if body.get("cut"):
            return StreamingResponse(_cut_json(), media_type="application/json")
        if "status" in body:
            error = {"message": "refused", "type": "BadRequestError", "param": None, "code": body["status"]}
            return JSONResponse({"error": error}, status_code=body["status"])
        return _EchoJSON(
            {
                "worker": self.name,
                "path": request.url.path,
                "authorization": request.headers.get("authorization"),
                "request_id": request.headers.get("x-request-id"),
                "fleet": request.headers.get(FLEET_HEADER),
                "raw": (await request.body()).decode("utf-8", "surrogateescape"),
                "body": body,
            }
        )

    async def _held(self) -> AsyncIterator[bytes]:
        try:
            yield EVENTS[0]
            yield EVENTS[1][:10]  # half an event, as a worker killed mid-write leaves it
            await asyncio.Event().wait()
        finally:  # the client went away: Starlette cancels the response
            self.left.put(1)


async def _pieces() -> AsyncIterator[bytes]:
    for piece in PIECES:
        yield piece


async def _cut_stream() -> AsyncIterator[bytes]:
    yield EVENTS[0]
    yield EVENTS[1][:10]
    raise RuntimeError("the worker dies mid-event")


async def _cut_json() -> AsyncIterator[bytes]:
    yield b'{"id": "chatcmpl-1", "choi'
    raise RuntimeError("the worker dies mid-answer")


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="standin")
    args = parser.parse_args()
    uvicorn.run(Standin(args.name).app, host="127.0.0.1", port=args.port, log_level="warning")
