"""OpenAI's error envelope: domain errors and HTTP-layer errors rendered by one set of handlers."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.db import unavailable_reason
from app.core.disk import DiskFull, is_disk_full
from app.core.errors import DomainError, Unauthenticated
from app.domain.errors import (
    Conflict,
    InvalidRequest,
    ModelNotServed,
    NotFound,
    TooManyActive,
    TooManyEstimates,
)
from app.domain.online import EngineUnavailable, error_event
from app.domain.openai_errors import missing_parameter, unrecognized_argument
from app.domain.ratelimits import RateLimited

log = logging.getLogger("vbatch.api")


class APIError(Exception):
    """An error of the HTTP layer itself (a form that cannot be parsed, a body too large)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_domain(exc: DomainError) -> APIError:
    if isinstance(exc, NotFound | ModelNotServed):
        return APIError(404, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, RateLimited):
        return _rate_limited(exc)
    if isinstance(exc, EngineUnavailable):
        headers = {"retry-after": str(ENGINE_RETRY_AFTER_SECONDS)}
        return APIError(503, exc.message, type="server_error", param=exc.param, code=exc.code, headers=headers)
    if isinstance(exc, Unauthenticated):
        return APIError(401, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, TooManyEstimates):
        return APIError(429, exc.message, code=exc.code, headers={"retry-after": str(exc.retry_after_seconds)})
    if isinstance(exc, TooManyActive):
        # OpenAI's SDKs retry a 429 at once unless told that waiting is what helps.
        headers = {"retry-after": str(exc.retry_after_seconds), "x-should-retry": "false"}
        return APIError(429, exc.message, param=exc.param, code=exc.code, headers=headers)
    if isinstance(exc, Conflict):
        return APIError(409, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequest):
        return bad_request(exc.message, param=exc.param, code=exc.code)
    return APIError(500, exc.message, type="server_error", param=exc.param, code=exc.code)


def _rate_limited(exc: RateLimited) -> APIError:
    """OpenAI's 429: of type "requests" or "tokens"; when to ask again in seconds and in milliseconds (the SDKs
    wait that long before their retry), or that no retry helps (a request larger than the limit itself)."""
    if exc.retry_after_seconds is None:
        headers = {"x-should-retry": "false"}
    else:
        headers = {
            "retry-after": str(max(1, math.ceil(exc.retry_after_seconds))),
            "retry-after-ms": str(max(1, math.ceil(exc.retry_after_seconds * 1000))),
        }
    return APIError(429, exc.message, type=exc.kind, param=exc.param, code=exc.code, headers=headers)


def engine_validation_error(error: dict) -> APIError:
    """The 400 for a body no request model of the engine's can take (pydantic's `error` as theirs would raise it: no
    JSON, or JSON that is not an object), in OpenAI's words, as vbatch's own routes answer such a body."""
    if error.get("type") == "model_attributes_type":
        return bad_request(_NOT_AN_OBJECT, code="invalid_json")
    return bad_request(_UNPARSED, code="invalid_json")


def from_error_object(status_code: int, error: dict) -> APIError:
    """An error object of OpenAI's (`app.domain.openai_errors`) as the HTTP error that carries it."""
    return APIError(status_code, error["message"], type=error["type"], param=error["param"], code=error["code"])


def request_too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is too large: JSON bodies are at most {limit} bytes.", code="request_too_large"
    )


def stream_error_event() -> bytes:
    """The event `vllm serve` ends a stream with when its engine fails mid-answer (the client's SDK raises it)."""
    return error_event(UNEXPECTED.message, kind="InternalServerError", code=500).encode()


def respond(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def _param_of(loc: tuple) -> str | None:
    """('body', 'metadata', 'k') -> 'metadata.k': the parameter's path inside its location."""
    return ".".join(str(part) for part in loc[1:]) or None


def _first_required_body_field(request: Request) -> str | None:
    """For a request with no body at all: the parameter OpenAI would name, the body model's first required one."""
    route = request.scope.get("route")
    body_field = getattr(route, "body_field", None) if isinstance(route, APIRoute) else None
    model = getattr(getattr(body_field, "field_info", None), "annotation", None)
    fields = getattr(model, "model_fields", {})
    return next((name for name, field in fields.items() if field.is_required()), None)


_UNPARSED = "We could not parse the JSON body of your request."
_NOT_AN_OBJECT = "The body of your request must be a JSON object."
# What FastAPI answers for a body its JSON decoding raised on other than with a decode error.
_FASTAPI_UNPARSED = "There was an error parsing the body"


def _from_validation(request: Request, exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "Invalid request.", "type": ""}
    loc = tuple(first.get("loc", ()))
    kind = first.get("type")
    if kind == "json_invalid":
        return bad_request(_UNPARSED, code="invalid_json")
    if kind in ("model_attributes_type", "dict_type") and loc == ("body",):
        return bad_request(_NOT_AN_OBJECT, code="invalid_json")
    param = _param_of(loc)
    if kind == "extra_forbidden" and param is not None:
        return from_error_object(400, unrecognized_argument(param))
    if kind == "missing":
        param = param or _first_required_body_field(request)
        if param is not None:
            return from_error_object(400, missing_parameter(param))
    return bad_request(f"Invalid value for '{param}': {first.get('msg')}.", param=param, code="invalid_value")


def _allowed_methods(app: FastAPI, path: str) -> str:
    """Every method the path answers to: Starlette's own `Allow` names only the first route that matched it. A
    path that some route names exactly (`/v1/batches/estimate`) is that route's resource, not a value of a templated
    one (`/v1/batches/{batch_id}`), as OpenAPI matches concrete paths before templated ones."""
    # A hidden route (`include_in_schema=False`) only turns a method away: it answers none.
    matching = [route for route in app.routes if _matches(route, path) and getattr(route, "include_in_schema", True)]
    exact = [route for route in matching if getattr(route, "path", None) == path]
    methods: set[str] = set()
    for route in exact or matching:
        methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _matches(route: object, path: str) -> bool:
    pattern = getattr(route, "path_regex", None)
    return pattern is not None and pattern.match(path) is not None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
        return respond(from_domain(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(_from_validation(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404 and message == "Not Found":
            message = "Unknown request URL. Please check the URL and method."
        if exc.status_code == 400 and message == _FASTAPI_UNPARSED:  # nested deeper than Python parses, say
            return respond(bad_request(_UNPARSED, code="invalid_json"))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(app, request.url.path)
        return respond(APIError(exc.status_code, message, type=kind, headers=headers))

    @app.exception_handler(DiskFull)
    async def _disk_full(_: Request, exc: DiskFull) -> JSONResponse:
        return respond(_INSUFFICIENT_STORAGE)

    @app.exception_handler(DBAPIError)
    async def _database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        if is_disk_full(exc):
            # Room for the database to take this request when it is asked again (the SDKs retry a 5xx).
            request.app.state.storage.reserve.release()
            return respond(_INSUFFICIENT_STORAGE)
        reason = unavailable_reason(exc)
        if reason is None:
            log_unexpected(request.method, request.url.path, exc)
            return respond(UNEXPECTED)
        log.warning("%s %s refused: %s", request.method, request.url.path, reason)
        return respond(database_unavailable(reason))

    # The request log (`app.main.RequestLog`) answers whatever no handler took; this is the last resort behind it.
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log_unexpected(request.method, request.url.path, exc)
        return respond(UNEXPECTED)


def log_unexpected(method: str, path: str, exc: BaseException) -> None:
    """The one record, with its traceback, of an exception that became a 500."""
    log.error("%s %s failed", method, path, exc_info=exc)


def database_unavailable(reason: str) -> APIError:
    """503: the SDKs retry it, after `retry-after`; nothing was changed."""
    return APIError(
        503,
        f"The database cannot take this request now ({reason}); nothing was changed. Try again later.",
        type="server_error",
        code="database_unavailable",
        headers={"retry-after": str(DATABASE_RETRY_AFTER_SECONDS)},
    )


def document_errors(app: FastAPI) -> None:
    """The OpenAPI document names the errors the server really sends: FastAPI would declare `422
    HTTPValidationError` on every operation with parameters, but every invalid request gets the 400 envelope."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = _ERROR_RESPONSE
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


DATABASE_RETRY_AFTER_SECONDS = 10
# An engine starting takes a minute or more; one restarting after a death about as long.
ENGINE_RETRY_AFTER_SECONDS = 5
UNEXPECTED = APIError(500, "The server had an error while processing your request.", type="server_error")
_INSUFFICIENT_STORAGE = APIError(
    507,
    "The server is out of disk space; nothing was changed or stored. Try again later.",
    type="server_error",
    code="insufficient_storage",
)

_ERROR_RESPONSE = {
    "description": "Bad Request",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
