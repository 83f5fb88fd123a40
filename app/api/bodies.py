"""An online request's body read as vLLM's serving layer reads it: a JSON object under a JSON content type, or the
400 its request models would give; 413 past the size allowed; a client that leaves while sending it, `ClientGone`.
"""

from __future__ import annotations

import json
from email.message import Message

from fastapi import Request
from starlette.requests import ClientDisconnect

from app.api.errors import APIError, engine_validation_error, request_too_large


class ClientGone(Exception):
    """The client left before its request's body had come."""


async def json_object(request: Request, most_bytes: int) -> tuple[bytes, dict]:
    """The body as sent and as a JSON object, or vLLM's 400 for what its request models would refuse (FastAPI's
    rules: JSON only under a JSON content type); 413 past `most_bytes`."""
    raw = await _body(request, most_bytes)
    if not _json_content_type(request.headers.get("content-type")):
        raise _not_an_object(f"<bytes of {len(raw)} bytes>")
    try:
        body = json.loads(raw) if raw else None
    except json.JSONDecodeError as exc:
        raise _invalid_json(exc.pos, exc.msg) from None
    except (ValueError, RecursionError):  # not UTF-8, an integer of too many digits, nesting too deep
        raise _invalid_json(0, "Expecting value") from None
    if body is None:
        raise engine_validation_error({"type": "missing", "loc": "body", "msg": "Field required", "input": "None"})
    if not isinstance(body, dict):
        raise _not_an_object(_summary(body))
    return raw, body


async def _body(request: Request, most_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > most_bytes:
        raise request_too_large(most_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > most_bytes:
                raise request_too_large(most_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def _json_content_type(value: str | None) -> bool:
    if not value:
        return False
    message = Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _invalid_json(position: int, reason: str) -> APIError:
    return engine_validation_error(
        {
            "type": "json_invalid",
            "loc": f"body.{position}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": reason},
        }
    )


def _not_an_object(shown: str) -> APIError:
    return engine_validation_error(
        {
            "type": "model_attributes_type",
            "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": shown,
        }
    )


def _summary(value: object) -> str:
    """A value as vLLM's validation error shows it: containers by size, text cut at 200 characters."""
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text
