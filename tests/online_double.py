"""A stand-in for the engine's online answers (`EngineView.respond`), patched onto the app's engine service: JSON
answers with their usage, or streams of the test's own bytes as vLLM writes them. It records every call and how
each ended, for tests on the API's side of online requests."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

from app.domain.online import EngineUnavailable, OnlineAnswer, OnlineRequest
from app.testing import FAKE_MODEL as MODEL

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None) -> bytes:
    delta = {key: value for key, value in (("role", role), ("content", content)) if value is not None}
    data = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def usage_chunk(usage: dict) -> bytes:
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": []}
    return f"data: {json.dumps({**data, 'usage': usage}, separators=(',', ':'))}\n\n".encode()


DONE = b"data: [DONE]\n\n"
CHAT_EVENTS = [chunk("", role="assistant"), chunk("Hel"), chunk("lo"), chunk("", finish="stop"), DONE]


def answer_for(endpoint: str, usage: dict) -> dict:
    if endpoint == "/v1/embeddings":
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
            "model": MODEL,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"]},
        }
    if endpoint == "/v1/completions":
        choice = {"index": 0, "text": "Hello", "finish_reason": "stop", "logprobs": None}
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL, "choices": [choice],
                "usage": usage}  # fmt: skip
    if endpoint == "/v1/responses":
        return {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL, "status": "completed",
                "output": [], "usage": {"input_tokens": usage["prompt_tokens"],
                                        "output_tokens": usage["completion_tokens"],
                                        "total_tokens": usage["total_tokens"]}}  # fmt: skip
    message = {"role": "assistant", "content": "Hello"}
    choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL, "choices": [choice],
            "usage": usage}  # fmt: skip


class OnlineDouble:
    """`respond` answers as the engine would. `events`: what a stream sends; `hold_after`: a stream sends that many
    events, then waits until it is closed; `hold`: a JSON answer never comes (the call waits until cancelled);
    `unavailable`: the state EngineUnavailable names. `closed` and `cancelled` are set (from the server's thread)
    when a stream's events were closed and when a held call was cancelled."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.tenants: list[str] = []  # whom each call was answered for
        self.events = list(CHAT_EVENTS)
        self.usage = dict(USAGE)
        self.status = 200
        self.hold_after: int | None = None
        self.hold = False
        self.unavailable: str | None = None
        self.closed = threading.Event()
        self.cancelled = threading.Event()
        self.sent = 0

    async def respond(self, request: OnlineRequest) -> OnlineAnswer:
        endpoint, body = request.endpoint, request.body
        self.calls.append((endpoint, body))
        self.tenants.append(request.tenant)
        if self.unavailable is not None:
            raise EngineUnavailable(self.unavailable)
        if body.get("stream"):
            return OnlineAnswer(self.status, events=self._stream())
        if self.hold:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return OnlineAnswer(self.status, body=answer_for(endpoint, self.usage))

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            for index, event in enumerate(self.events):
                if index == self.hold_after:
                    await asyncio.Event().wait()
                self.sent += 1
                yield event
        finally:
            self.closed.set()
