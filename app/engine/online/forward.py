"""Online requests through `vbatch api`, which has no engine: each goes to a worker that serves its model, the one
with the fewest online requests in flight, and comes back as the worker answered it, a stream byte for byte.

Only workers the fleet vouches for are sent anything (`app.core.fleet`): a worker whose beat proves its URL with the
fleet's secret, at an address `VBATCH_FLEET_NETWORKS` allows. What is sent is the body as the caller sent it, byte
for byte, and the caller's tenant, signed; never the caller's key. A worker served over https is checked against
`VBATCH_FLEET_CA_FILE` (or the system's CAs).

A worker's load is what it said at its last beat (`app.domain.workers`, a second old at most) plus what this replica
has sent it and not yet had back, so a burst between two beats spreads over the workers instead of piling onto the
one that looked idle. A worker that cannot be connected to is passed over (once per request, and for a few seconds
after); one that fails later may have started on the request, so the request ends with an error rather than run
twice: a JSON answer becomes `EngineUnavailable`, a stream ends with the error event vLLM itself sends when a
stream fails, never a hang. Closing a stream early closes its connection, so the worker sees its client leave and
aborts the request in its engine.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx

from app.core import calls
from app.core.fleet import FLEET_HEADER, FleetKey, Networks
from app.core.ids import new_id
from app.domain.online import EngineUnavailable, OnlineAnswer, OnlineRequest, error_event
from app.domain.workers import WorkerState

log = logging.getLogger("vbatch.forward")

# A worker on the same network connects in milliseconds; one that takes longer is down or cut off.
CONNECT_SECONDS = 3.0
# Below the worker's header timeout (VBATCH_HEADER_TIMEOUT_SECONDS, 10 s), after which it closes an idle connection:
# a connection is never reused just as the worker closes it.
KEEPALIVE_SECONDS = 5.0
# How long a worker that could not be connected to goes to the back of the line (its beats stop within
# `app.engine.online.view.SEEN_SECONDS` if it is gone).
PASSED_OVER_SECONDS = 5.0
# A connection that fails before anything was sent: the next worker is tried, once.
TRIES = 2
UNREACHABLE = "unreachable"


class Forwarder:
    """One HTTP/1.1 client, its connections kept alive, for the app's life."""

    def __init__(
        self, *, silence_seconds: float, fleet: FleetKey, networks: Networks, ca_file: Path | None = None
    ) -> None:
        self._fleet = fleet
        self._networks = networks
        self._untrusted: set[str] = set()  # holders already logged as not vouched for
        self._client = httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=ca_file) if ca_file is not None else True,
            # Read and write: between two bytes, so a long stream goes on as long as its events keep coming.
            timeout=httpx.Timeout(silence_seconds, connect=CONNECT_SECONDS, pool=None),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_SECONDS
            ),
            # Streams are passed on as received: nothing may arrive compressed.
            headers={"accept-encoding": "identity"},
        )
        self.in_flight: Counter[str] = Counter()  # sent by this replica and not answered yet, by worker (holder)
        self._passed_over: dict[str, float] = {}  # holder -> until when (monotonic)

    async def aclose(self) -> None:
        await self._client.aclose()

    def candidates(self, seen: list[WorkerState], model: object) -> list[WorkerState]:
        """The workers able to answer a request for `model` (None: any), the least busy first."""
        now = time.monotonic()
        self._passed_over = {holder: until for holder, until in self._passed_over.items() if until > now}
        able = [
            worker
            for worker in seen
            if worker.state == "ok"
            and (not isinstance(model, str) or model in worker.served_models)
            and self._vouched_for(worker)
        ]
        return sorted(
            able,
            key=lambda worker: (
                worker.holder in self._passed_over,
                worker.online_in_flight + self.in_flight[worker.holder],
            ),
        )

    def _vouched_for(self, worker: WorkerState) -> bool:
        """Whether `worker` may be sent a caller's request: its URL proven with the fleet's secret, at an allowed
        address. A row that fails is logged once: a worker with another secret, or one written by someone else."""
        url = worker.url
        if url and self._fleet.proves(worker.holder, url, worker.url_proof) and self._networks.allows(url):
            return True
        if url and worker.holder not in self._untrusted:
            self._untrusted.add(worker.holder)
            log.warning(
                "worker %s (%s) is not forwarded to: its URL is not proven with this fleet's secret "
                "(VBATCH_FLEET_SECRET) or is outside VBATCH_FLEET_NETWORKS",
                worker.holder,
                url,
            )
        return False

    async def forward(self, workers: list[WorkerState], request: OnlineRequest) -> OnlineAnswer:
        """The first of `workers` that can be connected to answers (at most `TRIES` are tried)."""
        for worker in workers[:TRIES]:
            try:
                return await self._forward(worker, request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.warning("worker %s (%s) cannot be connected to: %s", worker.holder, worker.url, type(exc).__name__)
                self._passed_over[worker.holder] = time.monotonic() + PASSED_OVER_SECONDS
        raise EngineUnavailable(UNREACHABLE)

    async def _forward(self, worker: WorkerState, online: OnlineRequest) -> OnlineAnswer:
        call = calls.current()
        request_id = call.request_id if call is not None else new_id("req_")
        signed = self._fleet.sign(tenant=online.tenant, request_id=request_id, path=online.endpoint, body=online.raw)
        headers = {"content-type": "application/json", "x-request-id": request_id, FLEET_HEADER: signed}
        request = self._client.build_request(
            "POST", f"{worker.url}{online.endpoint}", content=online.raw, headers=headers
        )
        self.in_flight[worker.holder] += 1
        relay: Finishing | None = None
        try:
            response = await self._client.send(request, stream=True)
            self._passed_over.pop(worker.holder, None)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                relay = _relay(response, lambda: self._done(worker.holder))
                return OnlineAnswer(response.status_code, events=relay)
            return OnlineAnswer(response.status_code, body=await _json_body(response))
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise  # nothing was sent: `forward` tries the next worker
        except httpx.HTTPError as exc:  # sent: the worker may have begun on it, so it is not sent again
            log.warning("worker %s (%s) failed mid-answer: %s", worker.holder, worker.url, type(exc).__name__)
            raise EngineUnavailable(UNREACHABLE) from exc
        finally:
            if relay is None:  # else the stream's end or close counts it done
                self._done(worker.holder)

    def _done(self, holder: str) -> None:
        self.in_flight[holder] -= 1
        if self.in_flight[holder] <= 0:
            del self.in_flight[holder]


async def _json_body(response: httpx.Response) -> dict:
    try:
        content = await response.aread()
    finally:
        await response.aclose()
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        log.warning("a worker answered %d with a body that is not a JSON object", response.status_code)
        raise EngineUnavailable(UNREACHABLE)
    return body


def _relay(response: httpx.Response, done: Callable[[], None]) -> Finishing:
    """A worker's stream, passed on a whole event at a time, its bytes as the worker sent them; `done` once it has
    ended or been closed, its connection closed (how the worker learns its client left: it aborts the request)."""

    async def finish() -> None:
        done()
        await response.aclose()

    return Finishing(_whole_events(response), finish)


async def _whole_events(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """A worker that dies mid-event leaves no half event for the client to parse; a stream cut short (the worker
    died, or sent nothing for the silence bound) ends with an error event."""
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            pending += chunk
            end = pending.rfind(b"\n\n") + 2
            if end >= 2:
                yield pending[:end]
                pending = pending[end:]
        if pending:
            yield pending
    except httpx.HTTPError as exc:
        log.warning("a forwarded stream was cut short: %s", type(exc).__name__)
        yield _worker_lost_event(exc)


class Finishing:
    """An answer's `events`, with `finish` awaited once when they end, fail or are closed, whether they had begun
    or not (an async generator closed before it began runs none of its code, its `finally` neither)."""

    def __init__(self, events: AsyncIterator[bytes], finish: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self._finish: Callable[[], Awaitable[None]] | None = finish

    def __aiter__(self) -> Finishing:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except BaseException:  # the end (StopAsyncIteration), a failure, or a cancel
            await self._finished()
            raise

    async def aclose(self) -> None:
        try:
            close = getattr(self._events, "aclose", None)
            if close is not None:
                await close()
        finally:
            await self._finished()

    async def _finished(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            await finish()


def _worker_lost_event(exc: httpx.HTTPError) -> bytes:
    """vLLM's own event for a stream that fails (`create_streaming_error_response`): an ErrorResponse."""
    if isinstance(exc, httpx.TimeoutException):
        message = "The worker answering this request stopped sending (no event for too long); try again."
    else:
        message = "The worker answering this request went away mid-answer; try again."
    return error_event(message, kind="ServiceUnavailableError", code=503).encode()
