from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from app.api.deps import DbDep, OwnerDep, SettingsDep, StorageDep
from app.api.uploads import store_upload
from app.domain import files
from app.domain.schemas import DeletedFile, ErrorResponse, FileList, OpenAIFile

router = APIRouter(
    prefix="/v1/files",
    tags=["files"],
    responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}},
)

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
                    "dependentRequired": {"expires_after[anchor]": ["expires_after[seconds]"]},
                }
            }
        },
    }
}


@router.post("", response_model=OpenAIFile, openapi_extra=_FILE_FORM, responses={413: {"model": ErrorResponse}})
async def create_file(
    request: Request, settings: SettingsDep, db: DbDep, storage: StorageDep, owner: OwnerDep
) -> OpenAIFile:
    row = await store_upload(request, storage=storage, settings=settings, db=db, owner=owner)
    return files.to_wire(row)


@router.get("", response_model=FileList)
def list_files(
    db: DbDep,
    owner: OwnerDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> FileList:
    return files.list_files(db=db, owner=owner, purpose=purpose, limit=limit, order=order, after=after)


@router.get("/{file_id}", response_model=OpenAIFile, responses={404: {"model": ErrorResponse}})
def retrieve_file(file_id: str, db: DbDep, owner: OwnerDep) -> OpenAIFile:
    return files.to_wire(files.get(db=db, file_id=file_id, owner=owner))


@router.delete("/{file_id}", response_model=DeletedFile, responses={404: {"model": ErrorResponse}})
async def delete_file(file_id: str, db: DbDep, storage: StorageDep, owner: OwnerDep) -> DeletedFile:
    await files.delete(db=db, storage=storage, file_id=file_id, owner=owner)
    return DeletedFile(id=file_id, deleted=True)


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        404: {"model": ErrorResponse},
    },
)
async def download_file(file_id: str, db: DbDep, storage: StorageDep, owner: OwnerDep) -> StreamingResponse:
    content = await files.open_content(db=db, storage=storage, file_id=file_id, owner=owner)
    return StreamingResponse(
        content.chunks,
        media_type="application/octet-stream",
        headers={"Content-Length": str(content.size)},
    )
