"""Front-end processes: vLLM's OpenAI serving layer spread over several processes, one engine behind them.

For short requests the engine waits on the front end: every line's pydantic request, chat template, tokenizer and
response object are CPU work in one Python event loop (issue 17: 556 requests/s where the engine alone does
1,256). `vllm serve --api-server-count N` answers that with N front-end processes, each an engine client of the
same engine core; vbatch starts the same processes with vLLM's own launcher (`vllm_adapter.live_frontends`) and
gives each one this module's `serve` loop instead of an HTTP server.

The engine loop keeps one executor: `FrontendPool.execute(endpoint, body)` sends the body to the front end with
the fewest requests in flight and returns what that front end's serving layer answered, so bodies are exactly what
one process would produce, and cancel, isolation and engine-death recovery work as they do in one process.

Messages go over one ZeroMQ socket pair per front end, pickled, and are coalesced: everything queued for a front
end while the event loop was busy leaves in one message, and the answers come back the same way.

Online requests (`FrontendPool.respond`) travel beside them in messages of their own, so a batch line's answer
costs what it did: a JSON answer, or a stream's start, its chunks and its end. A front end sends at most
`STREAM_ROOM` chunks of a stream the pool has not handed on, and the pool gives room back as its reader takes them,
so a slow reader holds its stream back in the front end (where vLLM merges the tokens nobody reads) rather than in a
buffer. A reader that goes away sends "abort", which cancels the front end's task, and vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import pickle
import signal
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from app.domain.adapters import Adapter
from app.domain.estimates import PromptCount
from app.domain.online import error_event
from app.domain.openai_errors import openai_error
from app.domain.results import Body, EncodedBody, encode_body
from app.engine.inference.serving import EngineDead, Serving, StepListener, Stream

log = logging.getLogger("vbatch.engine")

# From the engine's handshake to every front end's serving layer: about 30 s on 2 CPU cores, 6 s on an H200 host.
READY_TIMEOUT_SECONDS = 120.0
HEALTH_TIMEOUT_SECONDS = 30.0
# A process whose exit was seen is reaped within this; the event loop waits for it only to log the exit code.
EXIT_CODE_WAIT_SECONDS = 1.0
# A body the serving layer raised on, as vLLM's own exception handler answers it.
INTERNAL_ERROR = 500
# Chunks of one stream a front end sends ahead of its reader; room comes back a batch at a time.
STREAM_ROOM = 64
ROOM_BATCH = STREAM_ROOM // 4


# Measured on an H200 host (16 cores, docs/benchmarks.md): 14 front ends against 7 made embeddings 1.36x faster
# and left labels and tickets as they were; beyond that no host was measured, and each costs about 1.5 GB.
MAX_DEFAULT_FRONTENDS = 14


def default_count(cpu_count: int | None, *, engine_processes: int = 1) -> int:
    """Front-end processes when the user names none: a core each for the API process and for every busy engine
    process (`engine_processes`), the rest to front ends; one (no extra processes) on small hosts."""
    spare = (cpu_count or 1) - 1 - engine_processes
    return max(1, min(MAX_DEFAULT_FRONTENDS, spare))


def engine_processes(*, tensor_parallel: int, pipeline_parallel: int, data_parallel: int) -> int:
    """Busy processes of the engine: per data-parallel rank, its core, which is the model's worker too when one GPU
    runs the model, else beside a worker per GPU."""
    gpus = tensor_parallel * pipeline_parallel
    return data_parallel * (1 if gpus == 1 else 1 + gpus)


# Bodies a front end counts tokens of in one message (`FrontendPool.count_tokens`).
COUNT_PART = 2000
# Answers that are a value, not a (status, body) pair.
_PLAIN_ANSWERS = ("health", "count")


class NotReady(RuntimeError):
    """The front ends did not all report ready in time."""


@dataclass
class _Frontend:
    index: int
    process: BaseProcess
    identity: bytes | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    streams: dict[int, FrontendStream] = field(default_factory=dict)  # online streams it is sending
    outbox: list[tuple] = field(default_factory=list)
    alive: bool = True


class FrontendPool:
    """A `Serving` whose requests run in front-end processes; the engine's own numbers come from the launcher."""

    def __init__(
        self,
        *,
        address: str,
        processes: Sequence[BaseProcess],
        engine_processes: Sequence[BaseProcess],
        max_num_seqs: int,
        data_parallel_size: int,
        generated_tokens: Callable[[], int | None],
        metrics_text: Callable[[], bytes],
        engine_config: dict[str, object] | None = None,
        preemptions: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.data_parallel_size = data_parallel_size
        self.engine_config = engine_config or {"max_num_seqs": max_num_seqs, "data_parallel_size": data_parallel_size}
        self.served_models: list[str] = []
        self.adapters: list[Adapter] = []
        # The engine cores are not the front ends' children: their clients would wait for them for ever, so the
        # pool watches them and fails what is in flight when one exits, as `vllm serve` stops when one does.
        self._engine_processes = list(engine_processes)
        self._engine_lost = False
        self._generated_tokens = generated_tokens
        self._metrics_text = metrics_text
        self._preemptions = preemptions
        self._frontends = [_Frontend(i, p) for i, p in enumerate(processes)]
        self._by_identity: dict[bytes, _Frontend] = {}
        self._ids = itertools.count()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._step_listener: StepListener | None = None

    async def open(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Returns once every front end has its engine client and serving layer; raises if one dies first."""
        loop = asyncio.get_running_loop()
        for frontend in self._frontends:
            loop.add_reader(frontend.process.sentinel, self._lost, frontend)
        for process in self._engine_processes:
            loop.add_reader(process.sentinel, self._engine_exited, process)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._send())]
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            raise NotReady(f"front-end processes not ready within {timeout:.0f} s") from None
        if self._engine_lost or not all(f.alive for f in self._frontends):
            raise RuntimeError("a front-end or engine process exited while starting")
        log.info("%d front-end processes ready", len(self._frontends))

    async def close(self) -> None:
        for process in self._engine_processes:
            _unwatch(process)
        for frontend in self._frontends:
            _unwatch(frontend.process)
            self._fail(frontend, EngineDead("the front ends are stopping"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close(linger=0)
        self._context.term()

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        frontend = self._least_busy()
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        frontend.pending[request_id] = answer
        frontend.outbox.append(("run", request_id, endpoint, body, rank))
        self._wake.set()
        try:
            return await answer
        except asyncio.CancelledError:
            if frontend.pending.pop(request_id, None) is not None and frontend.alive:
                frontend.outbox.append(("abort", request_id))  # the engine stops generating it
                self._wake.set()
            raise

    async def respond(self, endpoint: str, body: dict) -> tuple[int, Body] | Stream:
        frontend = self._least_busy()
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        frontend.pending[request_id] = answer
        frontend.outbox.append(("respond", request_id, endpoint, body))
        self._wake.set()
        try:
            return await answer
        except asyncio.CancelledError:
            # Before its first answer, or with a stream that no one will read.
            if frontend.pending.pop(request_id, None) is not None or request_id in frontend.streams:
                self._abort(frontend, request_id)
            raise

    def _abort(self, frontend: _Frontend, request_id: int) -> None:
        frontend.streams.pop(request_id, None)
        if frontend.alive:
            frontend.outbox.append(("abort", request_id))
            self._wake.set()

    def _give_room(self, frontend: _Frontend, request_id: int, chunks: int) -> None:
        if frontend.alive:
            frontend.outbox.append(("room", request_id, chunks))
            self._wake.set()

    async def is_alive(self) -> bool:
        if self._engine_lost or not all(f.alive for f in self._frontends):
            return False
        checks = [self._ask_health(f) for f in self._frontends]
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_SECONDS):
                answers = await asyncio.gather(*checks)
        except (TimeoutError, EngineDead):
            return False
        return all(answers)

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        """In parts of `COUNT_PART` bodies, each sent to the front end least busy then: a large file is counted by
        every front end at once, the busiest last."""
        parts = [bodies[start : start + COUNT_PART] for start in range(0, len(bodies), COUNT_PART)]
        counted = await asyncio.gather(*(self._ask_count(endpoint, part) for part in parts))
        return [count for part in counted for count in part]

    async def _ask_count(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        frontend = self._least_busy()
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        frontend.pending[request_id] = answer
        frontend.outbox.append(("count", request_id, endpoint, bodies))
        self._wake.set()
        try:
            return await answer
        finally:
            frontend.pending.pop(request_id, None)

    def generated_tokens(self) -> int | None:
        return self._generated_tokens()

    def metrics_text(self) -> bytes:
        return self._metrics_text()

    def preemptions(self) -> int | None:
        return self._preemptions()

    def on_step(self, listener: StepListener) -> None:
        """Each engine step reaches one front end (the one vLLM sends its details to), which passes it on."""
        self._step_listener = listener

    def _least_busy(self) -> _Frontend:
        if self._engine_lost:
            raise EngineDead("the engine core exited")
        live = [f for f in self._frontends if f.alive]
        if not live:
            raise EngineDead("every front-end process is gone")
        return min(live, key=lambda f: len(f.pending) + len(f.streams))

    async def _ask_health(self, frontend: _Frontend) -> bool:
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        frontend.pending[request_id] = answer
        frontend.outbox.append(("health", request_id))
        self._wake.set()
        return bool(await answer)

    async def _send(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for frontend in self._frontends:
                if frontend.outbox and frontend.identity is not None:
                    batch, frontend.outbox = frontend.outbox, []
                    await self._socket.send_multipart([frontend.identity, pickle.dumps(batch, protocol=5)])

    async def _receive(self) -> None:
        while True:
            identity, payload = await self._socket.recv_multipart()
            message = pickle.loads(payload)
            if message[0] == "ready":
                self._greet(identity, index=message[1], served_models=message[2], adapters=message[3])
                continue
            frontend = self._by_identity[identity]
            if message[0] == "online":
                self._take_online(frontend, message[1])
                continue
            for request_id, status, body in message[1]:
                answer = frontend.pending.pop(request_id, None)
                if answer is None or answer.done():  # aborted meanwhile
                    continue
                if status is None:
                    answer.set_exception(EngineDead(body))
                else:
                    answer.set_result(body if status in _PLAIN_ANSWERS else (status, body))

    def _take_online(self, frontend: _Frontend, items: list[tuple]) -> None:
        """A front end's news of online requests: a stream's chunks, or a first answer, a stream's end, a death."""
        for request_id, kind, payload in items:
            if kind == "step":
                if self._step_listener is not None:
                    self._step_listener(payload)
            elif kind == "chunk":
                stream = frontend.streams.get(request_id)
                if stream is not None:  # else closed by its reader meanwhile
                    stream.put(payload)
            elif kind in ("end", "dead") and request_id in frontend.streams:
                frontend.streams.pop(request_id).finish(EngineDead(payload) if kind == "dead" else None)
            else:
                self._first_answer(frontend, request_id, kind, payload)

    def _first_answer(self, frontend: _Frontend, request_id: int, kind: str, payload: Any) -> None:
        answer = frontend.pending.pop(request_id, None)
        if answer is None or answer.done():  # its caller went away meanwhile
            return
        if kind == "start":
            stream = frontend.streams[request_id] = FrontendStream(self, frontend, request_id)
            answer.set_result(stream)
        elif kind == "json":
            answer.set_result(payload)
        else:
            answer.set_exception(EngineDead(payload))

    def _greet(self, identity: bytes, *, index: int, served_models: list[str], adapters: list[Adapter]) -> None:
        frontend = self._frontends[index]
        frontend.identity = identity
        self._by_identity[identity] = frontend
        self.served_models = served_models
        self.adapters = adapters
        self._wake.set()
        if all(f.identity is not None for f in self._frontends):
            self._ready.set()

    def _lost(self, frontend: _Frontend) -> None:
        _unwatch(frontend.process)
        if frontend.alive:
            log.log(*exit_record(frontend.process, f"front-end process {frontend.index}"))
        self._fail(frontend, EngineDead(f"front-end process {frontend.index} exited"))
        self._ready.set()  # a start that waits for it fails now, not at its timeout

    def _engine_exited(self, process: BaseProcess) -> None:
        _unwatch(process)
        log.log(*exit_record(process, f"engine process {process.name}"))
        self._engine_lost = True
        for frontend in self._frontends:
            self._fail(frontend, EngineDead(f"engine process {process.name} exited"))
        self._ready.set()

    @staticmethod
    def _fail(frontend: _Frontend, error: EngineDead) -> None:
        frontend.alive = False
        pending, frontend.pending = frontend.pending, {}
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(error)
        streams, frontend.streams = frontend.streams, {}
        for stream in streams.values():
            stream.finish(error)


class FrontendStream:
    """An online stream a front end sends, read on the pool's loop: the server-sent events as its serving layer
    yields them. Its reader closing it, or cancelled while it waits, aborts the request; a front end or engine that
    dies ends it with EngineDead."""

    def __init__(self, pool: FrontendPool, frontend: _Frontend, request_id: int) -> None:
        self._pool = pool
        self._frontend = frontend
        self._request_id = request_id
        self._chunks: deque[str] = deque()
        self._arrived = asyncio.Event()
        self._finished = False
        self._error: EngineDead | None = None
        self._taken = 0

    def put(self, chunk: str) -> None:
        self._chunks.append(chunk)
        self._arrived.set()

    def finish(self, error: EngineDead | None) -> None:
        """It ends after the chunks already come (with `error` raised, if any)."""
        self._finished, self._error = True, error
        self._arrived.set()

    def __aiter__(self) -> FrontendStream:
        return self

    async def __anext__(self) -> str:
        while not self._chunks:
            if self._finished:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._arrived.clear()
            try:
                await self._arrived.wait()
            except asyncio.CancelledError:
                self._abandon()
                raise
        self._taken += 1
        if self._taken == ROOM_BATCH:
            self._taken = 0
            self._pool._give_room(self._frontend, self._request_id, ROOM_BATCH)
        return self._chunks.popleft()

    async def aclose(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if not self._finished:
            self.finish(None)
            self._pool._abort(self._frontend, self._request_id)


def exit_record(process: BaseProcess, name: str) -> tuple[int, str]:
    """The level and message that log a watched process's exit. SIGTERM or SIGINT is how a service manager or a
    Ctrl-C stops the whole process group, so those are warnings; any other exit is an error."""
    with contextlib.suppress(AssertionError):  # join() asserts that we are the parent; the code is then unknown
        process.join(EXIT_CODE_WAIT_SECONDS)  # the sentinel is readable before the child is reaped
    code = process.exitcode
    if code is None or code >= 0:
        return logging.ERROR, f"{name} exited (code {code})"
    stopped = -code in (signal.SIGTERM, signal.SIGINT)
    return (logging.WARNING if stopped else logging.ERROR), f"{name} stopped by {signal.Signals(-code).name}"


def _unwatch(process: BaseProcess) -> None:
    """Stop watching a process's exit (it has been seen, or the pool is closing)."""
    with contextlib.suppress(Exception):
        asyncio.get_running_loop().remove_reader(process.sentinel)


async def serve(serving: Serving, address: str, index: int) -> None:
    """A front-end process's loop: run what the pool sends through `serving`, answer in batches, until the pool
    goes away (the launcher then stops the process)."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    frontend_loop = _FrontendLoop(serving, socket, index)
    log.info("front end %d: serving layer ready", index)
    sender = asyncio.create_task(frontend_loop.send())
    watch = asyncio.create_task(_orphaned(index))
    await socket.send(pickle.dumps(("ready", index, serving.served_models, serving.adapters), protocol=5))
    try:
        await frontend_loop.receive_until(watch)
    finally:
        sender.cancel()
        watch.cancel()
        frontend_loop.cancel_running()
        socket.close(linger=0)
        context.term()


class _FrontendLoop:
    """A front end's side of its socket to the pool: the requests it runs, and their answers, sent in batches."""

    def __init__(self, serving: Serving, socket: zmq.asyncio.Socket, index: int) -> None:
        self.serving = serving
        self.socket = socket
        self.index = index
        self.answers: list[tuple] = []
        self.online: list[tuple] = []  # news of online requests, sent apart from the answers
        self.wake = asyncio.Event()
        self.running: dict[int, asyncio.Task] = {}
        self.rooms: dict[int, asyncio.Semaphore] = {}  # the chunks each stream may still send ahead of its reader
        serving.on_step(lambda step: self.tell((None, "step", step)))  # with the online news: sent at once

    async def receive_until(self, watch: asyncio.Task) -> None:
        """Take what the pool sends until `watch` ends (vbatch is gone)."""
        while not watch.done():
            receiving = asyncio.ensure_future(self.socket.recv())
            await asyncio.wait([receiving, watch], return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                receiving.cancel()
                break
            for item in pickle.loads(receiving.result()):
                self.dispatch(item)

    def dispatch(self, item: tuple) -> None:
        kind, request_id = item[0], item[1]
        if kind == "run":
            self.running[request_id] = asyncio.create_task(self.run(request_id, *item[2:]))
        elif kind == "abort":
            task = self.running.pop(request_id, None)
            if task is not None:
                task.cancel()
        elif kind == "health":
            self.running[request_id] = asyncio.create_task(self.health(request_id))
        elif kind == "count":
            self.running[request_id] = asyncio.create_task(self.count(request_id, *item[2:]))
        elif kind == "respond":
            self.running[request_id] = asyncio.create_task(self.respond(request_id, *item[2:]))
        elif kind == "room" and request_id in self.rooms:
            for _ in range(item[2]):
                self.rooms[request_id].release()

    async def run(self, request_id: int, endpoint: str, body: dict, rank: int | None) -> None:
        try:
            status, result = await self.serving.execute(endpoint, body, rank)
            self.answer((request_id, status, result if isinstance(result, EncodedBody) else encode_body(result)))
        except EngineDead as exc:
            self.answer((request_id, None, str(exc)))
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the serving layer answers errors itself; this is a last resort
            log.exception("front end %d: request failed", self.index)
            self.answer((request_id, INTERNAL_ERROR, encode_body(_internal_error(exc))))
        finally:
            self.running.pop(request_id, None)

    async def respond(self, request_id: int, endpoint: str, body: dict) -> None:
        stream: Stream | None = None
        try:
            answer = await self.serving.respond(endpoint, body)
            if isinstance(answer, tuple):
                self.tell((request_id, "json", answer))
                return
            stream = answer
            await self.send_stream(request_id, stream)
        except EngineDead as exc:
            self.tell((request_id, "dead", str(exc)))
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the serving layer answers errors itself; this is a last resort
            log.exception("front end %d: online request failed", self.index)
            self.tell_failure(request_id, exc, started=stream is not None)
        finally:
            self.running.pop(request_id, None)
            self.rooms.pop(request_id, None)
            if stream is not None and hasattr(stream, "aclose"):
                await stream.aclose()  # left at a chunk (cancelled while waiting for room): this aborts it

    async def send_stream(self, request_id: int, stream: Stream) -> None:
        room = self.rooms[request_id] = asyncio.Semaphore(STREAM_ROOM)
        self.tell((request_id, "start", None))
        async for chunk in stream:
            await room.acquire()
            self.tell((request_id, "chunk", chunk))
        self.tell((request_id, "end", None))

    def tell_failure(self, request_id: int, exc: Exception, *, started: bool) -> None:
        if not started:
            self.tell((request_id, "json", (INTERNAL_ERROR, _internal_error(exc))))
            return
        self.tell((request_id, "chunk", error_event(str(exc), kind="InternalServerError", code=INTERNAL_ERROR)))
        self.tell((request_id, "end", None))

    def tell(self, item: tuple) -> None:
        self.online.append(item)
        self.wake.set()

    async def health(self, request_id: int) -> None:
        try:
            self.answer((request_id, "health", await self.serving.is_alive()))
        finally:
            self.running.pop(request_id, None)

    async def count(self, request_id: int, endpoint: str, bodies: list[dict]) -> None:
        try:
            self.answer((request_id, "count", await self.serving.count_tokens(endpoint, bodies)))
        except Exception:  # a last resort: the serving layer counts what it can and says None for the rest
            log.exception("front end %d: counting tokens failed", self.index)
            self.answer((request_id, "count", [None] * len(bodies)))
        finally:
            self.running.pop(request_id, None)

    def answer(self, item: tuple) -> None:
        self.answers.append(item)
        self.wake.set()

    async def send(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.answers:
                batch, self.answers = self.answers, []
                await self.socket.send(pickle.dumps(("done", batch), protocol=5))
            if self.online:
                news, self.online = self.online, []
                await self.socket.send(pickle.dumps(("online", news), protocol=5))

    def cancel_running(self) -> None:
        for task in list(self.running.values()):
            task.cancel()


async def _orphaned(index: int) -> None:
    """A `kill -9` of vbatch leaves no front end behind: it exits when its parent is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("front end %d: vbatch exited; stopping", index)


def await_chain(task: asyncio.Task) -> list[str]:
    """Where a task waits, outermost first, through every coroutine and async generator it awaits
    (`Task.print_stack` shows only the outermost frame of a suspended task, which says nothing about a hang)."""
    places: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        if type(awaited).__name__ == "async_generator_asend":  # an async generator's step: into the generator
            awaited = next((ref for ref in gc.get_referents(awaited) if hasattr(ref, "ag_frame")), None)
            continue
        frame = _first_attr(awaited, ("cr_frame", "gi_frame", "ag_frame"))
        if frame is None:
            places.append(f"  waiting on {awaited!r}"[:300])
            break
        places.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = _first_attr(awaited, ("cr_await", "gi_yieldfrom", "ag_await"))
    return places


def _first_attr(value: Any, names: tuple[str, ...]) -> Any:
    return next((getattr(value, name) for name in names if getattr(value, name, None) is not None), None)


def watch_for_stack_dumps() -> None:
    """`kill -USR1` of a front end logs what each of its tasks waits on: a front end that hangs says where."""

    def dump() -> None:
        for task in asyncio.all_tasks():
            log.warning("front end task %s awaits:\n%s", task.get_name(), "\n".join(await_chain(task)))

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)


def _internal_error(exc: Exception) -> dict[str, Any]:
    return {"error": openai_error(INTERNAL_ERROR, {"message": str(exc), "code": INTERNAL_ERROR})}
