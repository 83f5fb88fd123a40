"""OpenAI's error envelope, raised from anywhere and rendered by one handler."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(kind: str, object_id: str, param: str = "id") -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", param=param)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _respond(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "form")]
    return ".".join(parts) or None


def _from_validation(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "Invalid request.", "type": ""}
    param = _param_of(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if first.get("type") in ("json_invalid", "model_attributes_type", "dict_type") and param is None:
        return bad_request("We could not parse the JSON body of your request.", code="invalid_json")
    return bad_request(f"Invalid value for '{param}': {first.get('msg')}.", param=param, code="invalid_value")


def _allowed_methods(app: FastAPI, path: str) -> str:
    """Every method the path answers to: Starlette's own `Allow` names only the first route that matched it."""
    methods: set[str] = set()
    for route in app.routes:
        pattern = getattr(route, "path_regex", None)
        if pattern is not None and pattern.match(path):
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(_from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404 and message == "Not Found":
            message = "Unknown request URL. Please check the URL and method."
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(app, request.url.path)
        return _respond(APIError(exc.status_code, message, type=kind), headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _respond(APIError(500, "The server had an error while processing your request.", type="server_error"))
