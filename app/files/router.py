from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Header, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from app.core.deps import CurrentKey, SessionDep, SettingsDep
from app.core.pagination import ListPage
from app.files import service
from app.files.schemas import FileDeleted, FileObject

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("", response_model=FileObject)
async def create_file(
    request: Request,
    principal: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File(description="The JSONL file to upload.")],
    purpose: Annotated[str, Form(description="'fine-tune' (training data) or 'evals' (an eval run's items).")],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> FileObject:
    service.check_purpose(purpose)
    service.check_filename(file.filename)
    storage = request.app.state.storage
    # The multipart parser has already spooled the upload to a temporary file on disk; copy it
    # to storage in chunks, off the event loop.
    blob = await run_in_threadpool(service.store_upload, storage, file.file, max_bytes=settings.max_upload_bytes)
    try:
        return await run_in_threadpool(
            service.create_file, session=session, storage=storage, project_id=principal.project_id, blob=blob,
            filename=file.filename or "upload.jsonl", purpose=purpose, idempotency_key=idempotency_key,
        )
    except BaseException:
        storage.delete(blob.key)
        raise


@router.get("", response_model=ListPage[FileObject])
def list_files(
    principal: CurrentKey,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> ListPage[FileObject]:
    return service.list_files(
        session=session, project_id=principal.project_id, after=after, limit=limit, order=order, purpose=purpose
    )


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, principal: CurrentKey, session: SessionDep) -> FileObject:
    return service.get_file(session=session, project_id=principal.project_id, file_id=file_id)


@router.get("/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, request: Request, principal: CurrentKey, session: SessionDep) -> StreamingResponse:
    row = service.get_row(session=session, project_id=principal.project_id, file_id=file_id)
    return StreamingResponse(
        request.app.state.storage.iter_chunks(row.storage_key),
        media_type="application/octet-stream",
        headers={"Content-Length": str(row.bytes), "Content-Disposition": f'attachment; filename="{row.filename}"'},
    )


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, request: Request, principal: CurrentKey, session: SessionDep) -> FileDeleted:
    storage_key = service.delete_file(session=session, project_id=principal.project_id, file_id=file_id)
    session.commit()  # the bytes go only once the row is gone for good
    request.app.state.storage.delete(storage_key)
    return FileDeleted(id=file_id)
