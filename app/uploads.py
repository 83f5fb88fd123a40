"""Reads the multipart form of `POST /v1/files` into what files.create_upload needs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import UploadFile

from app.config import Settings
from app.errors import bad_request

_READ_BYTES = 1 << 20
MIN_TTL, MAX_TTL = 3600, 2_592_000


@dataclass
class Upload:
    file: UploadFile
    filename: str
    purpose: str
    ttl_seconds: int | None

    @property
    def chunks(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self.file.read(_READ_BYTES):
            yield chunk

    async def close(self) -> None:
        await self.file.close()


def _ttl(form, purpose: str, settings: Settings) -> int | None:
    anchor = form.get("expires_after[anchor]")
    seconds = form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return settings.batch_file_ttl_seconds if purpose == "batch" else None
    if anchor != "created_at":
        raise bad_request("'expires_after[anchor]' must be 'created_at'.", param="expires_after.anchor")
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not MIN_TTL <= value <= MAX_TTL:
        raise bad_request(
            f"'expires_after[seconds]' must be an integer from {MIN_TTL} to {MAX_TTL}.",
            param="expires_after.seconds",
        )
    return value


async def parse_upload(request: Request, *, settings: Settings) -> Upload:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("Uploads must be multipart/form-data with fields 'file' and 'purpose'.", param="file")
    form = await request.form()
    file = form.get("file")
    if not isinstance(file, UploadFile):
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    purpose = form.get("purpose")
    if not isinstance(purpose, str):
        await file.close()
        raise bad_request("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
    try:
        ttl = _ttl(form, purpose, settings)
    except Exception:
        await file.close()
        raise
    return Upload(file=file, filename=file.filename or "upload", purpose=purpose, ttl_seconds=ttl)
