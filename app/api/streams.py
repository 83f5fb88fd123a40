"""An online answer on its way to the client: a stream's events timed as they pass (`vbatch_live_*`), its end
measured once however it comes, and the engine's request ended when its client leaves."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.api.errors import log_unexpected, stream_error_event
from app.domain.answers import AnswerWording
from app.domain.online import OnlineAnswer
from app.domain.ratelimits import Quota, output_tokens, used_tokens
from app.engine.telemetry.metrics import OnlineMetrics

# What marks a streamed event that carries output, by endpoint: vLLM writes one such event a token by default.
OUTPUT_MARKS = {"/v1/chat/completions": b'"delta"', "/v1/completions": b'"text"', "/v1/responses": b'.delta"'}
# The endpoints whose streams end with `[DONE]`, after an error event too (vLLM's chat and completions generators
# send it once their try block ends); a Responses stream has none.
_DONE = b"data: [DONE]\n\n"
_ENDS_WITH_DONE = ("/v1/chat/completions", "/v1/completions")


class MeteredCall(Protocol):
    """The online request a stream answers: where its timings go and how its end is charged."""

    endpoint: str
    key: str
    model: str
    started: float
    metrics: OnlineMetrics

    def settle(self, used: int | None) -> Quota: ...

    def ended(self, output: int, usage: object) -> None: ...


class MeasuredEvents:
    """The engine's events as they pass to the client, timed (the first that carries output is the first token, the
    time between two such is an inter-token latency), its usage kept to settle the key's charge, and worded as
    OpenAI's (`app.domain.answers`). Closing it closes the engine's events (the engine aborts
    the request); an engine that fails mid-stream ends it with vLLM's error event, never a cut."""

    def __init__(self, events: AsyncIterator[bytes], call: MeteredCall, wording: AnswerWording) -> None:
        self._events = events
        self._call = call
        self._wording = wording
        self._mark = OUTPUT_MARKS.get(call.endpoint, b'"delta"')
        self._last_output: float | None = None
        self._outputs = 0
        self._usage: dict | None = None
        self._tail: list[bytes] = []
        self._closed = False
        self._done_owed = call.endpoint in _ENDS_WITH_DONE  # until a [DONE] passes

    def __aiter__(self) -> MeasuredEvents:
        return self

    async def __anext__(self) -> bytes:
        while True:
            event = await self._next()
            reworded = self._wording.events(event)
            if reworded:  # else only a usage the client did not ask for: the next event goes instead
                return reworded

    async def _next(self) -> bytes:
        if self._tail:
            return self._tail.pop(0)
        if self._closed:
            raise StopAsyncIteration
        try:
            event = await anext(self._events)
        except StopAsyncIteration:
            await self.aclose()
            if self._done_owed:  # a stream cut after its error event (an engine or a worker gone): end it as vLLM does
                self._done_owed = False
                return _DONE
            raise
        except Exception as exc:
            log_unexpected("POST", self._call.endpoint, exc)
            await self.aclose()
            self._tail = [stream_error_event(), *([_DONE] if self._done_owed else [])]
            self._done_owed = False
            return self._tail.pop(0)
        self._seen(event)
        return event

    def _seen(self, event: bytes) -> None:
        metrics, call = self._call.metrics, self._call
        if _DONE in event:
            self._done_owed = False
        if self._mark in event:
            now = time.perf_counter()
            if self._last_output is None:
                metrics.time_to_first_token.labels(call.key, call.model).observe(now - call.started)
            else:
                metrics.inter_token_latency.labels(call.key, call.model).observe(now - self._last_output)
            self._last_output = now
            self._outputs += 1
        if b'"usage"' in event and (b'"completion_tokens"' in event or b'"output_tokens"' in event):
            self._usage = streamed_usage(event) or self._usage

    async def aclose(self) -> None:
        """Idempotent; the stream's end (last event sent, client gone or failed) is measured once, here."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._events, "aclose", None)
            if close is not None:
                await close()
        finally:
            used = used_tokens(self._usage)
            if used is not None:
                self._call.settle(used)
            self._call.ended(output_tokens(self._usage) or self._outputs, self._usage)


class EventStream(StreamingResponse):
    """`text/event-stream`, as `vllm serve` sends a stream; its events are closed however the response ends (the
    client gone mid-stream, or before the first byte), so the engine aborts what nobody reads any more."""

    def __init__(self, events: MeasuredEvents, *, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(events, status_code=status_code, headers=headers, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


async def unless_client_leaves(call: Awaitable[OnlineAnswer], request: Request) -> OnlineAnswer | None:
    """The call's answer, or None once the client has gone, the call cancelled (the engine aborts the request), as
    vLLM's `with_cancellation` races a handler with its client's disconnect."""
    answer = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_client_gone(request.receive))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        answer.cancel()  # nothing once it is done
    await asyncio.gather(answer, gone, return_exceptions=True)
    if answer.cancelled():
        return None
    result = answer.result()  # or the call's own error, raised
    if result.events is not None and gone.done() and not gone.cancelled():
        await _close(result.events)  # a stream that began as its client left
        return None
    return result


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _close(events: AsyncIterator[bytes]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


def streamed_usage(event: bytes) -> dict | None:
    """The `usage` a streamed event carries (chat and completions with `stream_options.include_usage`; responses in
    its `response.completed` event), or None."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            data = json.loads(line[len(b"data: ") :])
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict):
            response = data.get("response")
            usage = data.get("usage") or (response.get("usage") if isinstance(response, dict) else None)
            if isinstance(usage, dict):
                return usage
    return None
