"""The FastAPI application: routes, error envelope, request ids, and the engine service's lifespan.

One app, three roles: `serve` (the API and the engine in one process, the default), `api` (the API only: any
number of replicas over one database and one files directory, reading the engines' state from the workers'
beats) and `worker` (the engine only, running the batches it claims; HTTP for /health, /metrics and /v1/models).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import StrEnum

from fastapi import FastAPI, Request
from sqlalchemy.engine import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__
from app.api import batches as batch_routes
from app.api import files as file_routes
from app.api import online as online_routes
from app.api import system as system_routes
from app.api.errors import UNEXPECTED, document_errors, install_error_handlers, log_unexpected, respond
from app.api.guard import HostRule, RequestGuard
from app.console import routes as console_routes
from app.console.sessions import SessionSigner, load_secret
from app.core import calls, clock
from app.core.auth import KeyRing, key_settings
from app.core.config import Settings
from app.core.db import Claim, claim_database, make_engine
from app.core.disk import DiskReserve
from app.core.fleet import FleetKey, FleetSecretMissing
from app.core.ids import new_id
from app.core.migrate import upgrade_to_head
from app.core.storage import Storage, keep_private
from app.core.stores import open_storage
from app.domain import batches, retention
from app.domain.adapters import RecentMisses
from app.domain.estimate_slots import EstimateSlots
from app.domain.ratelimits import RateLimiter
from app.domain.sweep import ORPHAN_AGE_SECONDS, sweep_storage
from app.engine.online.view import EngineView
from app.engine.telemetry.metrics import Metrics, State
from app.outbox import Outbox, endpoints_from

log = logging.getLogger("vbatch.api")


class Role(StrEnum):
    SERVE = "serve"
    API = "api"
    WORKER = "worker"


access_log = logging.getLogger("vbatch.access")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def create_app(settings: Settings, engine: EngineView, role: Role = Role.SERVE) -> FastAPI:
    docs = settings.api_docs  # Swagger UI and ReDoc load their scripts from a public CDN onto this origin
    app = FastAPI(
        title="vbatch",
        version=__version__,
        description="OpenAI-compatible Files and Batch API over a live vLLM engine.",
        lifespan=_lifespan(settings, engine, role),
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.settings = settings
    app.state.keys = KeyRing(settings.read_api_keys())
    app.state.fleet = _fleet_key(settings, role)
    app.state.online_limits = _online_limits(settings, role)
    app.state.unknown_models = RecentMisses()
    app.state.estimate_slots = EstimateSlots(per_key=settings.max_estimates_per_key, in_all=settings.max_estimates)
    app.state.engine = engine
    app.state.metrics = Metrics()
    app.state.metrics.watch(lambda: metrics_state(app.state.db, engine, app.state.storage.reserve))
    _add_middleware(app, settings, role)
    install_error_handlers(app)
    document_errors(app)
    _include_routes(app, role)
    return app


def _fleet_key(settings: Settings, role: Role) -> FleetKey | None:
    """The fleet's key: replicas and workers, which trust each other by it, start only with one."""
    fleet = settings.fleet_key()
    if fleet is None and role != Role.SERVE:
        raise FleetSecretMissing(
            f"vbatch {role} needs VBATCH_FLEET_SECRET (or VBATCH_FLEET_SECRET_FILE), the same on every API replica "
            "and worker: workers prove where they answer with it and replicas sign the tenant of each request they "
            "forward with it (e.g. `openssl rand -hex 32`)"
        )
    return fleet


def _online_limits(settings: Settings, role: Role) -> RateLimiter:
    """Charged where a request enters: `vbatch serve`, or each `vbatch api` replica. A worker answers what a replica
    forwards, already charged there, so it charges nothing again (its port is the cluster's inside, not a front)."""
    own = key_settings(settings.api_keys_file)  # read in every role: a bad line stops any of them at start
    if role == Role.WORKER:
        return RateLimiter.from_settings(rpm=0, tpm=0, key_settings={})
    return RateLimiter.from_settings(rpm=settings.live_rpm, tpm=settings.live_tpm, key_settings=own)


def _lifespan(settings: Settings, engine: EngineView, role: Role) -> Callable[[FastAPI], AbstractAsyncContextManager]:
    endpoints = endpoints_from(settings)  # a malformed webhook setting stops the start, not the first event
    alone = role == Role.SERVE

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        keep_private(settings.data_dir)
        app.state.console_signer = SessionSigner(load_secret(settings.data_dir))
        claim = await asyncio.to_thread(_open_stores, app, settings, alone)
        await engine.start(
            db=app.state.db,
            storage=app.state.storage,
            settings=settings,
            metrics=app.state.metrics,
            hold_at_most=None if alone else settings.worker_batches,
        )
        background = []
        if role != Role.WORKER:
            background.append(asyncio.create_task(_keep_retention(app.state.db, app.state.storage, settings)))
        # Without a webhook, events wait in the outbox (a webhook configured later gets the last 72 h').
        if endpoints.any and role != Role.WORKER:
            outbox = Outbox(db=app.state.db, endpoints=endpoints, settings=settings, metrics=app.state.metrics)
            background.append(asyncio.create_task(outbox.run()))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await _drain(engine, settings.drain_seconds)
            await asyncio.to_thread(_close_database, claim, app.state.db)

    return lifespan


def _open_stores(app: FastAPI, settings: Settings, alone: bool) -> Claim:
    """The database migrated and claimed, the storage opened and swept: blocking work, for a thread of its own."""
    upgrade_to_head(settings.database)
    app.state.db = make_engine(
        settings.database, pool_size=settings.database_pool_size, pooler=settings.database_pooler
    )
    claim = claim_database(app.state.db, settings.data_dir, exclusive=alone)
    reserve = DiskReserve(
        settings.data_dir / "reserve", size=settings.disk_reserve_bytes, keep_free=settings.min_free_disk_bytes
    )
    app.state.storage = open_storage(settings.storage_url, settings.files_dir, reserve)
    reserve.keep()
    # Alone, whatever nobody refers to is a crash's leftover; beside other processes only what is also old.
    sweep_storage(db=app.state.db, storage=app.state.storage, min_age_seconds=0 if alone else ORPHAN_AGE_SECONDS)
    return claim


def _close_database(claim: Claim, db: Engine) -> None:
    claim.close()
    db.dispose()


def _add_middleware(app: FastAPI, settings: Settings, role: Role) -> None:
    """The guard, inside the request log (added last, so outermost): its refusals are logged and carry ids too. Only a
    worker takes requests the fleet forwarded, on the fleet's signature instead of a key."""
    keys: KeyRing = app.state.keys
    app.add_middleware(
        RequestGuard,
        keys=keys,
        fleet=app.state.fleet if role == Role.WORKER else None,
        hosts=HostRule.of_service(listed=settings.allowed_hosts, served_on=settings.host, keys=keys.enabled),
        max_json_bytes=settings.max_json_body_bytes,
        body_grace=settings.header_timeout_seconds,
        min_body_rate=settings.min_body_bytes_per_second,
    )
    app.add_middleware(RequestLog)


def _include_routes(app: FastAPI, role: Role) -> None:
    # Every role answers online requests: with its own engine (serve, worker), or a worker's (api).
    if role == Role.WORKER:
        app.include_router(online_routes.router)
        app.include_router(system_routes.router)
        return
    app.include_router(file_routes.router)
    app.include_router(batch_routes.router)
    app.include_router(online_routes.router)
    app.include_router(system_routes.router)
    app.include_router(console_routes.router)


class RequestLog:
    """One access record per request, under the client's `x-request-id` when it sent a sane one (echoed back), else
    a new one; meanwhile the id is the request's `app.core.calls.Call`, which `vbatch api` passes on to the worker it
    forwards an online request to. An exception no handler took is logged here, once
    with its traceback, and answered with the 500 envelope: it goes no further, where Starlette and uvicorn would
    log it again (and this record would be lost)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        request_id = _client_request_id(request.headers.get("x-request-id")) or new_id("req_")
        started = time.perf_counter()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            with calls.answering(calls.Call(request_id)):
                await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log_unexpected(request.method, request.url.path, exc)
            if status is None:
                await respond(UNEXPECTED)(scope, receive, send_with_id)
            status = 500  # a body cut short is the server's failure too
        fields = {
            "request_id": request_id,
            "method": request.method,
            "path": request.url.path,
            "status": status or 500,  # none sent: uvicorn answers 500
            "duration_ms": round((time.perf_counter() - started) * 1000, 1),
        }
        access_log.info("%s %s %d", request.method, request.url.path, fields["status"], extra=fields)


def metrics_state(db: Engine, engine: EngineView, disk: DiskReserve) -> State:
    return State(
        batches_by_status=batches.count_by_status(db=db),
        lines_waiting=batches.lines_waiting(db=db),
        running=engine.live_rates(),
        engine_deaths=engine.deaths,
        engine_up=engine.state == "ok",
        disk_free_bytes=disk.free_bytes(),
        disk_reserve_held=disk.held,
    )


async def _drain(engine: EngineView, deadline: float) -> None:
    """No batch starts from here; running ones stop with their results checkpointed. Past the deadline the process
    exits anyway: what is checkpointed is safe, and the next start resumes from it."""
    try:
        async with asyncio.timeout(deadline):
            await engine.stop()
    except TimeoutError:
        log.error("the engine did not stop within VBATCH_DRAIN_SECONDS (%s s); exiting without it", deadline)


async def _keep_retention(db: Engine, storage: Storage, settings: Settings) -> None:
    while True:
        try:
            await retention.sweep(
                db=db, storage=storage, now=clock.now(), keep_events_seconds=settings.retention_events_seconds
            )
        except Exception:
            log.exception("the retention sweep failed; it runs again in %s s", settings.retention_sweep_seconds)
        await asyncio.sleep(settings.retention_sweep_seconds)


def _client_request_id(value: str | None) -> str | None:
    return value if value is not None and REQUEST_ID.fullmatch(value) else None
