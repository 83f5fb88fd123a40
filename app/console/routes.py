"""The console's pages, fragments and forms. Like `app.api`, these only translate HTTP to domain calls, made under
the session's owner id: a page shows what the API shows that key, and another key's object is "not found"."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.types import Receive, Scope, Send

from app.api.deps import DbDep, EngineDep, EstimateSlotsDep, MetricsDep, SettingsDep, StorageDep
from app.api.errors import from_domain
from app.api.system import health_status
from app.api.uploads import store_upload
from app.console import CONSOLE_STATIC, present, sessions
from app.console.access import (
    CSRF_FIELD,
    ChangeDep,
    Forbidden,
    LoginRequired,
    SessionDep,
    anonymous_allowed,
    check_origin,
    cookie_attributes,
    from_script,
    keys_of,
    login_url,
    new_session_cookie,
    safe_next,
    signer_of,
)
from app.console.headers import with_console_headers
from app.console.sessions import Session
from app.core.errors import DomainError, Unauthenticated
from app.core.gpu import gpu_usage
from app.domain import batches, files, retry
from app.domain.errors import InvalidRequest
from app.domain.lifecycle import ACTIVE, BatchStatus
from app.domain.online import EngineUnavailable
from app.domain.partial_output import Kind, first_lines, open_partial
from app.domain.schemas import CreateBatchRequest
from app.engine.online import estimating
from app.engine.online.estimating import check_file

PAGE_SIZE = 20
FIRST_ERROR_LINES = 10
HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters.update(present.FILTERS)
STATIC = StaticFiles(directory=CONSOLE_STATIC)


class ConsoleRoute(APIRoute):
    """Refusals as a browser needs them: a page without a session goes to the login page, a domain error is an
    error page (a fragment or script gets its status and message)."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def console_handler(request: Request) -> Response:
            try:
                return await handle(request)
            except LoginRequired:
                return _login_required(request)
            except Forbidden:
                return _refusal(request, 403, "This form has expired or did not come from this console. Reload.")
            except DomainError as exc:
                return _refusal(request, from_domain(exc).status_code, exc.message)

        return console_handler

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().handle(scope, receive, with_console_headers(send))


pages = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


def _page(request: Request, template: str, session: Session | None, status_code: int = 200, **context) -> Response:
    csrf = signer_of(request).csrf_token(session) if session is not None else ""
    context |= {"csrf_token": csrf, "csrf_field": CSRF_FIELD, "keys_enabled": keys_of(request).enabled}
    return templates.TemplateResponse(request, template, context, status_code=status_code)


def _refusal(request: Request, status: int, message: str) -> Response:
    if from_script(request):
        return JSONResponse({"error": {"message": message}}, status_code=status)
    return _page(request, "error.html", None, status_code=status, message=message)


def _login_required(request: Request) -> Response:
    if anonymous_allowed(request) and request.method == "GET":
        # Without keys the console is loopback's, as the API is: a session is all the visitor lacked.
        response: Response = RedirectResponse(str(request.url), status_code=303)
        response.set_cookie(**new_session_cookie(request))
        return response
    if from_script(request):
        return JSONResponse({"error": {"message": "Log in again."}}, status_code=401)
    return RedirectResponse(login_url(request), status_code=303)


@pages.get("")
@pages.get("/")
def home() -> Response:
    return RedirectResponse("/console/batches", status_code=303)


@pages.api_route("/static/{name}", methods=["GET", "HEAD"])
async def static_file(request: Request, name: str) -> Response:
    """console.js and console.css (with StaticFiles' ETag and 304s), served by this router rather than a mount so
    that they carry the console's headers too."""
    return await STATIC.get_response(name, request.scope)


@pages.get("/login")
def login_page(request: Request, next: str | None = None) -> Response:
    if anonymous_allowed(request):
        return RedirectResponse(safe_next(next), status_code=303)
    return _page(request, "login.html", None, next=safe_next(next))


@pages.post("/login")
def login(request: Request, key: Annotated[str, Form()], next: Annotated[str, Form()] = "") -> Response:
    check_origin(request)
    try:
        owner = keys_of(request).owner(f"Bearer {key}")
    except Unauthenticated:
        return _page(request, "login.html", None, status_code=401, next=safe_next(next), failed=True)
    response: Response = RedirectResponse(safe_next(next), status_code=303)
    response.set_cookie(**new_session_cookie(request, owner))
    return response


@pages.post("/logout")
def logout(request: Request, session: ChangeDep, db: DbDep) -> Response:
    # Deleting the cookie is not enough: a copy of it (another tab's, a stolen one) would work for hours.
    sessions.end(db=db, session=session)
    response: Response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(**cookie_attributes(request))
    return response


def _status_filter(status: str | None) -> BatchStatus | None:
    if not status:
        return None
    try:
        return BatchStatus(status)
    except ValueError:
        raise InvalidRequest(f"Unknown status '{status}'.", param="status") from None


def _batch_rows(db, engine, session: Session, status: str | None, after: str | None, price: float | None) -> dict:
    # A form sends an unset filter or cursor as an empty string.
    listing = batches.list_batches(
        db=db, owner=session.owner, limit=PAGE_SIZE, after=after or None, status=_status_filter(status)
    )
    spent = batches.spent_by_id(db=db, batch_ids=[batch.id for batch in listing.data], price=price)
    return {
        "batches": [present.batch_row(batch, engine.live_stats(batch.id), spent[batch.id]) for batch in listing.data],
        "priced": price is not None,
        "has_more": listing.has_more,
        "last_id": listing.last_id,
        "status": status or "",
        "after": after or "",
    }


@pages.get("/batches")
@pages.get("/batches/rows")  # before /batches/{batch_id}, which would take "rows" for an id
def batches_page(
    request: Request,
    session: SessionDep,
    db: DbDep,
    engine: EngineDep,
    settings: SettingsDep,
    status: str | None = None,
    after: str | None = None,
) -> Response:
    """The page, or (`/rows`) the table rows that console.js refreshes."""
    rows = _batch_rows(db, engine, session, status, after, settings.gpu_hour_price)
    if request.url.path.endswith("/rows"):
        return _page(request, "_batch_rows.html", session, **rows)
    return _page(request, "batches.html", session, statuses=[s.value for s in BatchStatus], **rows)


async def _batch_context(batch_id: str, session: Session, db, storage, engine, price: float | None) -> dict:
    row, stats, served = await asyncio.to_thread(_batch_and_stats, batch_id, session, db, engine)
    batch = batches.to_wire(row)
    progress = batches.progress(row, stats, served, price)
    error_lines = await first_lines(
        db=db, storage=storage, batch_id=batch_id, kind="error", owner=session.owner, count=FIRST_ERROR_LINES
    )
    return {
        "retryable": await retry.retryable_lines(db=db, storage=storage, row=row),
        "batch": batch,
        "progress": progress,
        "row": present.batch_row(batch, stats, batches.spent(row, price)),
        "timeline": present.lifecycle(batch),
        "run_stages": present.run_stages(progress.timeline),
        "error_lines": [present.error_line(line) for line in error_lines],
        "active": batch.status in ACTIVE,
    }


def _batch_and_stats(batch_id: str, session: Session, db, engine) -> tuple:
    """An API replica's engine view reads a batch's live numbers, and the models the workers serve, from the
    database too."""
    row = batches.get(db=db, batch_id=batch_id, owner=session.owner)
    return row, engine.live_stats(row.id), engine.served_models


@pages.get("/batches/{batch_id}")
@pages.get("/batches/{batch_id}/panel")
async def batch_page(
    request: Request,
    batch_id: str,
    session: SessionDep,
    db: DbDep,
    storage: StorageDep,
    engine: EngineDep,
    settings: SettingsDep,
) -> Response:
    """The page, or (`/panel`) the part of it that console.js refreshes."""
    context = await _batch_context(batch_id, session, db, storage, engine, settings.gpu_hour_price)
    template = "_batch_panel.html" if request.url.path.endswith("/panel") else "batch.html"
    return _page(request, template, session, **context)


@pages.get("/batches/{batch_id}/progress.json")
def batch_progress(batch_id: str, session: SessionDep, db: DbDep, engine: EngineDep, settings: SettingsDep) -> Response:
    row = batches.get(db=db, batch_id=batch_id, owner=session.owner)
    progress = batches.progress(row, engine.live_stats(row.id), engine.served_models, settings.gpu_hour_price)
    return JSONResponse(progress.model_dump(mode="json"))


@pages.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, session: ChangeDep, db: DbDep, engine: EngineDep) -> Response:
    batches.request_cancel(db=db, batch_id=batch_id, owner=session.owner)
    engine.wake()
    return RedirectResponse(f"/console/batches/{batch_id}", status_code=303)


@pages.post("/batches/{batch_id}/retry")
async def retry_batch(
    batch_id: str, session: ChangeDep, db: DbDep, storage: StorageDep, settings: SettingsDep, engine: EngineDep
) -> Response:
    answer = await retry.retry(
        db=db,
        storage=storage,
        batch_id=batch_id,
        owner=session.owner,
        windows=settings.allowed_windows,
        max_active=settings.max_active_batches_per_key,
    )
    engine.wake()
    return RedirectResponse(f"/console/batches/{answer.batch.id}", status_code=303)


@pages.get("/batches/{batch_id}/partial")
async def partial_download(
    batch_id: str,
    session: SessionDep,
    db: DbDep,
    storage: StorageDep,
    kind: Kind = "output",
) -> Response:
    chunks, size = await open_partial(db=db, storage=storage, batch_id=batch_id, kind=kind, owner=session.owner)
    headers = {
        "Content-Length": str(size),
        "Content-Disposition": f'attachment; filename="{batch_id}.{kind}.partial.jsonl"',
    }
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@pages.get("/submit")
def submit_page(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    return _page(request, "submit.html", session, endpoints=batches.ENDPOINTS, windows=list(settings.allowed_windows))


@pages.post("/uploads")
async def upload(
    request: Request,
    session: ChangeDep,
    settings: SettingsDep,
    db: DbDep,
    storage: StorageDep,
    engine: EngineDep,
    slots: EstimateSlotsDep,
    endpoint: str = "/v1/chat/completions",
) -> Response:
    """Stores a batch file (the API's own upload path) and checks it line by line before any batch exists: whole-file
    work, bounded as estimates are (`EstimateSlots`)."""
    with slots.taken(session.owner):
        row = await store_upload(request, storage=storage, settings=settings, db=db, owner=session.owner)
        path = await storage.local_path(row.id)
        report = await asyncio.to_thread(check_file, path, settings, endpoint, engine)
        estimate = await _estimate(db, settings, engine, endpoint, row.id, path, report)
    problems = [error.model_dump() for error in report.errors]
    return JSONResponse(
        {
            "file": files.to_wire(row).model_dump(),
            "total": report.total,
            "error_count": report.error_count,
            "problems": problems,
            "estimate": estimate,
        }
    )


async def _estimate(db, settings, engine, endpoint: str, file_id: str, path: Path, report) -> dict | None:
    """The estimate of a valid file (`POST /v1/batches/estimate`'s), shown before the batch is created; None while
    no engine can count its tokens."""
    if not report.ok:
        return None
    try:
        found = await estimating.of_checked(
            db=db, settings=settings, engine=engine, endpoint=endpoint, file_id=file_id, path=path, report=report
        )
    except EngineUnavailable:
        return None
    return found.model_dump(mode="json")


@pages.post("/batches")
def create_batch(
    request: Request,
    session: ChangeDep,
    db: DbDep,
    settings: SettingsDep,
    engine: EngineDep,
    input_file_id: Annotated[str, Form()],
    endpoint: Annotated[str, Form()],
    completion_window: Annotated[str, Form()],
    metadata: Annotated[str, Form()] = "",
) -> Response:
    body = CreateBatchRequest(
        input_file_id=input_file_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=present.parse_metadata(metadata),
    )
    row = batches.create(
        db=db,
        request=body,
        windows=settings.allowed_windows,
        owner=session.owner,
        max_active=settings.max_active_batches_per_key,
    )
    engine.wake()
    return RedirectResponse(f"/console/batches/{row.id}", status_code=303)


@pages.get("/files")
def files_page(request: Request, session: SessionDep, db: DbDep, after: str | None = None) -> Response:
    listing = files.list_files(db=db, owner=session.owner, purpose=None, limit=PAGE_SIZE, order="desc", after=after)
    return _page(request, "files.html", session, files=listing.data, has_more=listing.has_more, last_id=listing.last_id)


@pages.get("/files/{file_id}/content")
async def file_download(file_id: str, session: SessionDep, db: DbDep, storage: StorageDep) -> Response:
    content = await files.open_content(db=db, storage=storage, file_id=file_id, owner=session.owner)
    headers = {
        "Content-Length": str(content.size),
        "Content-Disposition": f'attachment; filename="{present.download_name(content.row)}"',
    }
    return StreamingResponse(content.chunks, media_type="application/octet-stream", headers=headers)


@pages.post("/files/{file_id}/delete")
async def delete_file(request: Request, file_id: str, session: ChangeDep, db: DbDep, storage: StorageDep) -> Response:
    await files.delete(db=db, storage=storage, file_id=file_id, owner=session.owner, keep_if_in_use=True)
    return RedirectResponse("/console/files", status_code=303)


@pages.get("/engine")
def engine_page(
    request: Request,
    session: SessionDep,
    engine: EngineDep,
    settings: SettingsDep,
    storage: StorageDep,
    db: DbDep,
    metrics: MetricsDep,
) -> Response:
    gpus = gpu_usage()
    health = health_status(engine, settings, storage, db)
    steps, pace = engine.engine_steps()
    return _page(
        request,
        "engine.html",
        session,
        engine=engine,
        health=health,
        gpus=gpus,
        config=sorted(engine.engine_config.items()),
        rates=present.throughput(engine.live_rates(), metrics.online.rates.rates()),
        steps=steps,
        pace=pace,
        window=engine.batch_window,
    )


# What app.main includes: the console, and the base URL sending a browser to it (the API is under /v1).
router = APIRouter(include_in_schema=False)
router.include_router(pages)


@router.get("/")
def base_url() -> Response:
    return RedirectResponse("/console/", status_code=307)
