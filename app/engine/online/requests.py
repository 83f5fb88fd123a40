"""Online requests (`app.domain.online`) from the API's event loop to the engine thread's, and their answers back.

`EngineService.respond` is called on the API's loop; the engine lives on the engine thread's (`bridge.py`). Each
request runs there as a task of its own (`asyncio.run_coroutine_threadsafe`), beside the batches' lines but outside
their in-flight window and their fair feed: the engine's priorities put it ahead of them. What it answers comes back
through a `Handoff`, a queue on the caller's loop filled with `call_soon_threadsafe`. A stream puts at most
`STREAM_ROOM` chunks there that the caller has not taken; then the engine side stops reading the stream, so a slow
client slows only its own request and nothing grows without limit (vLLM merges the tokens of a request nobody reads
into its next output).

Every way a request can end reaches the caller: the engine task's end (answered, failed, cancelled) is put in the
queue after what it sent, and a service that stops ends every request still open, so no caller waits for ever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from app.domain.online import EngineUnavailable, OnlineAnswer, OnlineRequest, as_online, error_event
from app.domain.results import Body, EncodedBody
from app.engine.inference.bridge import EngineThread
from app.engine.inference.serving import EngineDead, Stream
from app.engine.sharing.recovering import RecoveringEngine

log = logging.getLogger("vbatch.engine")

# Chunks of one stream on their way to a caller that has not taken them yet.
STREAM_ROOM = 64
# Credits go back to the engine loop in batches: one cross-thread call for this many chunks taken.
CREDIT_BATCH = STREAM_ROOM // 4


@dataclass(frozen=True)
class _Ended:
    """The last item of every request: None when it ended as it should, else why not."""

    error: BaseException | None


_STREAMING = "streaming"  # the first item of an answer that is a stream; its chunks (bytes) follow


class Handoff:
    """One request's items, from the engine loop to the caller's loop."""

    def __init__(self, caller: asyncio.AbstractEventLoop, engine: asyncio.AbstractEventLoop) -> None:
        self._caller = caller
        self._engine = engine
        self._items: asyncio.Queue[Any] = asyncio.Queue()  # used on the caller's loop only
        self._room = asyncio.Semaphore(STREAM_ROOM)  # used on the engine loop only
        self._taken = 0

    def send(self, item: Any) -> None:
        """From any thread; dropped when the caller's loop has closed (nobody waits any more)."""
        with contextlib.suppress(RuntimeError):
            self._caller.call_soon_threadsafe(self._items.put_nowait, item)

    async def send_chunk(self, chunk: bytes) -> None:
        """On the engine loop: waits while the caller holds `STREAM_ROOM` chunks it has not taken."""
        await self._room.acquire()
        self.send(chunk)

    def end(self, error: BaseException | None) -> None:
        self.send(_Ended(error))

    async def take(self) -> Any:
        """On the caller's loop: the next item."""
        item = await self._items.get()
        if isinstance(item, bytes):
            self._taken += 1
            if self._taken == CREDIT_BATCH:
                self._taken = 0
                with contextlib.suppress(RuntimeError):  # the engine loop has closed
                    self._engine.call_soon_threadsafe(self._release, CREDIT_BATCH)
        return item

    def _release(self, credits: int) -> None:
        for _ in range(credits):
            self._room.release()


class OnlineEvents:
    """A stream's server-sent events on the caller's loop, as bytes. Closing it, cancelling a wait for its next
    event, or dropping it unclosed cancels the engine task, which aborts the request in the engine. An engine that
    dies mid-stream ends it with an error event, as vLLM's own streams end on an error."""

    def __init__(self, handoff: Handoff, task: concurrent.futures.Future) -> None:
        self._handoff = handoff
        self._task = task
        self._ended = False
        weakref.finalize(self, task.cancel)

    def __aiter__(self) -> OnlineEvents:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._handoff.take()
        except asyncio.CancelledError:
            self._close()
            raise
        if isinstance(item, _Ended):
            self._ended = True
            if item.error is None:
                raise StopAsyncIteration
            return stream_error_event(item.error)
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._ended:
            self._ended = True
            self._task.cancel()


def stream_error_event(error: BaseException) -> bytes:
    """The event that ends a stream the engine could not finish: vLLM's error envelope, as its streams send one."""
    if isinstance(error, (EngineDead, asyncio.CancelledError, concurrent.futures.CancelledError)):
        message = "The engine stopped while answering this request; try again shortly."
        kind, code = "ServiceUnavailableError", 503
    else:
        message, kind, code = "The request failed in the engine.", "InternalServerError", 500
    return error_event(message, kind=kind, code=code).encode()


class OnlineRequests:
    """The online requests of one engine service: `respond` on the caller's loop, each request's task on the engine
    loop, and the ones still open, which `close` ends when the service stops."""

    def __init__(self, *, engine: RecoveringEngine, bridge: EngineThread, window: Callable[[], Any]) -> None:
        self._engine = engine
        self._bridge = bridge
        # The batch window's observer of online traffic (`online_arrived`, `online_first_token`, `online_done`),
        # called on the engine loop; None while there is none.
        self._window = window
        self._lock = threading.Lock()
        self._open: dict[int, tuple[concurrent.futures.Future, Handoff]] = {}
        self._ids = itertools.count()
        self._closed = False
        self.shared_cache = False  # `VBATCH_SHARED_PREFIX_CACHE`, set as the service starts

    @property
    def in_flight(self) -> int:
        """Requests the engine is still answering (a stream until its last event is made), from any thread: what a
        worker's beat tells `vbatch api` to pick the least busy worker by."""
        return len(self._open)

    def opened(self) -> None:
        """On the engine loop, as the service's lifetime begins."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """The service stops: requests still open end now (their tasks are cancelled: the engine aborts them) and
        later ones are refused. From any thread."""
        with self._lock:
            self._closed = True
            still_open, self._open = list(self._open.values()), {}
        for task, handoff in still_open:
            task.cancel()
            handoff.end(EngineDead("the engine service is stopping"))

    async def respond(self, request: OnlineRequest) -> OnlineAnswer:
        started = time.monotonic()
        engine_loop, state = self._bridge.loop, self._engine.state
        if engine_loop is None or state != "ok":
            # An engine thread that has ended leaves its engine's last state behind.
            raise EngineUnavailable("stopped" if state == "ok" else state)
        engine_body = as_online(request, shared_cache=self.shared_cache)
        handoff = Handoff(asyncio.get_running_loop(), engine_loop)
        task = self._start(engine_loop, self._answer(request.endpoint, engine_body, handoff, started), handoff)
        try:
            first = await handoff.take()
        except BaseException:  # the caller went away (cancelled): so does the request
            task.cancel()
            raise
        if first == _STREAMING:
            return OnlineAnswer(200, events=OnlineEvents(handoff, task))
        if isinstance(first, _Ended):
            raise self._unavailable(first.error)
        status, answer = first
        return OnlineAnswer(status, body=_as_dict(answer))

    def _start(
        self, engine_loop: asyncio.AbstractEventLoop, answer: Coroutine[Any, Any, None], handoff: Handoff
    ) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                answer.close()
                raise EngineUnavailable("stopping")
            try:
                task = asyncio.run_coroutine_threadsafe(answer, engine_loop)
            except RuntimeError:  # the engine loop has closed since it was read
                answer.close()
                raise EngineUnavailable("stopping") from None
            request_id = next(self._ids)
            self._open[request_id] = (task, handoff)
        task.add_done_callback(lambda done: self._ended(request_id, done, handoff))
        return task

    def _ended(self, request_id: int, task: concurrent.futures.Future, handoff: Handoff) -> None:
        """On the engine thread (or the caller's, for a task cancelled before it ran)."""
        with self._lock:
            self._open.pop(request_id, None)
        error = None if not task.cancelled() and task.exception() is None else _error_of(task)
        handoff.end(error)
        if isinstance(error, EngineDead):
            self._bridge.wake()  # with no batch running, the loop's next look restarts the engine

    def _unavailable(self, error: BaseException | None) -> BaseException:
        if error is None or isinstance(error, (EngineDead, concurrent.futures.CancelledError)):
            state = self._engine.state
            return EngineUnavailable(state if state != "ok" else "restarting")
        return error

    async def _answer(self, endpoint: str, body: dict, handoff: Handoff, started: float) -> None:
        """On the engine loop: the request, and what it answers put in `handoff`."""
        window = self._window()
        if window is not None:
            window.online_arrived(body)
        self._engine.engine_time.started()
        try:
            answer = await self._engine.respond(endpoint, body)
            if isinstance(answer, tuple):
                _first_token(window, started)
                handoff.send(answer)
                return
            handoff.send(_STREAMING)
            await _pump(answer, handoff, window, started)
        finally:
            self._engine.engine_time.ended()
            if window is not None:
                window.online_done()


async def _pump(stream: Stream, handoff: Handoff, window: Any, started: float) -> None:
    first = True
    try:
        async for event in stream:
            if first:
                _first_token(window, started)
                first = False
            await handoff.send_chunk(event.encode())
    finally:
        # Cancelled while waiting for room, the stream is left at a chunk: closing it is what aborts the request.
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _first_token(window: Any, started: float) -> None:
    if window is not None:
        window.online_first_token(time.monotonic() - started)


def _error_of(task: concurrent.futures.Future) -> BaseException:
    return concurrent.futures.CancelledError() if task.cancelled() else task.exception() or RuntimeError()


def _as_dict(body: Body) -> dict:
    """A body a front-end process encoded (an embedding's, kept as vLLM rendered it) as the JSON the API sends."""
    return json.loads(body.json) if isinstance(body, EncodedBody) else body
