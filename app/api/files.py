from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from app import files
from app.api.deps import DbDep, SettingsDep, StorageDep
from app.errors import bad_request
from app.schemas import DeletedFile, ErrorResponse, FileList, OpenAIFile
from app.uploads import parse_upload

router = APIRouter(prefix="/v1/files", tags=["files"], responses={400: {"model": ErrorResponse}})

_FILE_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(files.UPLOAD_PURPOSES)},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
                    },
                }
            }
        },
    }
}


@router.post("", response_model=OpenAIFile, openapi_extra=_FILE_FORM, responses={413: {"model": ErrorResponse}})
async def create_file(request: Request, settings: SettingsDep, db: DbDep, storage: StorageDep) -> OpenAIFile:
    upload = await parse_upload(request, settings=settings)
    try:
        row = await files.create_upload(
            db=db,
            storage=storage,
            chunks=upload.chunks,
            filename=upload.filename,
            purpose=upload.purpose,
            ttl_seconds=upload.ttl_seconds,
            max_bytes=settings.upload_limit(upload.purpose),
        )
    finally:
        await upload.close()
    return files.to_wire(row)


@router.get("", response_model=FileList)
def list_files(
    db: DbDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> FileList:
    return files.list_files(db=db, purpose=purpose, limit=limit, order=order, after=after)


@router.get("/{file_id}", response_model=OpenAIFile, responses={404: {"model": ErrorResponse}})
def retrieve_file(file_id: str, db: DbDep) -> OpenAIFile:
    return files.to_wire(files.get(db=db, file_id=file_id))


@router.delete("/{file_id}", response_model=DeletedFile, responses={404: {"model": ErrorResponse}})
async def delete_file(file_id: str, db: DbDep, storage: StorageDep) -> DeletedFile:
    await files.delete(db=db, storage=storage, file_id=file_id)
    return DeletedFile(id=file_id, deleted=True)


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        404: {"model": ErrorResponse},
    },
)
def download_file(file_id: str, db: DbDep, storage: StorageDep) -> StreamingResponse:
    row = files.get(db=db, file_id=file_id)
    if not storage.exists(file_id):
        raise bad_request(f"The content of file {file_id} is not available.", param="file_id")
    chunks: AsyncIterator[bytes] = storage.read_chunks(file_id)
    return StreamingResponse(
        chunks,
        media_type="application/octet-stream",
        headers={"Content-Length": str(row.bytes)},
    )
