"""The FastAPI application: routes, error envelope, request ids, and the engine service's lifespan."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from sqlalchemy.engine import Engine

from app import __version__
from app.api import batches as batch_routes
from app.api import files as file_routes
from app.api import system as system_routes
from app.api.errors import document_errors, install_error_handlers
from app.api.guard import RequestGuard
from app.console import CONSOLE_STATIC
from app.console import routes as console_routes
from app.console.sessions import SessionSigner, load_secret
from app.core import clock
from app.core.auth import KeyRing
from app.core.config import Settings
from app.core.db import claim_database, make_engine
from app.core.disk import DiskReserve
from app.core.ids import new_id
from app.core.migrate import upgrade_to_head
from app.core.storage import Storage, keep_private
from app.domain import batches, retention
from app.domain.sweep import sweep_storage
from app.engine.service import EngineService
from app.metrics import Metrics, State
from app.outbox import Outbox, endpoints_from

log = logging.getLogger("vbatch.api")
access_log = logging.getLogger("vbatch.access")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def create_app(settings: Settings, engine: EngineService) -> FastAPI:
    endpoints = endpoints_from(settings)  # a malformed webhook setting stops the start, not the first event

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        keep_private(settings.data_dir)
        app.state.console_signer = SessionSigner(load_secret(settings.data_dir))
        upgrade_to_head(settings.database)
        app.state.db = make_engine(settings.database)
        claim = claim_database(app.state.db)
        reserve = DiskReserve(
            settings.data_dir / "reserve", size=settings.disk_reserve_bytes, keep_free=settings.min_free_disk_bytes
        )
        app.state.storage = Storage(settings.files_dir, reserve)
        reserve.keep()
        sweep_storage(db=app.state.db, storage=app.state.storage)
        await engine.start(db=app.state.db, storage=app.state.storage, settings=settings, metrics=app.state.metrics)
        background = [asyncio.create_task(_keep_retention(app.state.db, app.state.storage, settings))]
        if endpoints.any:  # without one, events wait in the outbox (a webhook configured later gets the last 72 h')
            outbox = Outbox(db=app.state.db, endpoints=endpoints, settings=settings, metrics=app.state.metrics)
            background.append(asyncio.create_task(outbox.run()))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await _drain(engine, settings.drain_seconds)
            if claim is not None:
                claim.close()
            app.state.db.dispose()

    app = FastAPI(
        title="vbatch",
        version=__version__,
        description="OpenAI-compatible Files and Batch API over a live vLLM engine.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.keys = KeyRing(settings.read_api_keys())
    app.add_middleware(
        RequestGuard,
        keys=app.state.keys,
        max_json_bytes=settings.max_json_body_bytes,
        body_grace=settings.header_timeout_seconds,
        min_body_rate=settings.min_body_bytes_per_second,
    )
    app.state.engine = engine
    app.state.metrics = Metrics()
    app.state.metrics.watch(lambda: metrics_state(app.state.db, engine))
    install_error_handlers(app)
    document_errors(app)

    @app.middleware("http")
    async def request_log(request: Request, call_next):
        """One record per request, under the client's `x-request-id` when it sent a sane one (echoed back)."""
        request_id = _client_request_id(request.headers.get("x-request-id")) or new_id("req_")
        started = time.perf_counter()
        response = await call_next(request)
        response.headers["x-request-id"] = request_id
        fields = {
            "request_id": request_id,
            "method": request.method,
            "path": request.url.path,
            "status": response.status_code,
            "duration_ms": round((time.perf_counter() - started) * 1000, 1),
        }
        access_log.info("%s %s %d", request.method, request.url.path, response.status_code, extra=fields)
        return response

    app.include_router(file_routes.router)
    app.include_router(batch_routes.router)
    app.include_router(system_routes.router)
    app.include_router(console_routes.router)
    app.mount("/console/static", StaticFiles(directory=CONSOLE_STATIC), name="console-static")
    return app


def metrics_state(db: Engine, engine: EngineService) -> State:
    return State(
        batches_by_status=batches.count_by_status(db=db),
        lines_waiting=batches.lines_waiting(db=db),
        running=engine.live_rates(),
        engine_deaths=engine.live.deaths,
        engine_up=engine.state == "ok",
    )


async def _drain(engine: EngineService, deadline: float) -> None:
    """No batch starts from here; running ones stop with their results checkpointed. Past the deadline the process
    exits anyway: what is checkpointed is safe, and the next start resumes from it."""
    try:
        await asyncio.wait_for(asyncio.shield(engine.stop()), timeout=deadline)
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
