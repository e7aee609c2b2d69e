"""`/internal/v1/files/{id}/content`: the bytes of any project's file, for the workers that
train on it (they serve every project and hold no database or storage credentials)."""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from app.core.deps import SessionDep, require_worker
from app.core.errors import APIError
from app.files import service

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])


@router.get("/files/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, request: Request, session: SessionDep) -> StreamingResponse:
    """The bytes of any project's file (training and validation data)."""
    row = service.get_row_for_worker(session=session, file_id=file_id)
    chunks = request.app.state.storage.iter_chunks(row.storage_key)
    try:  # open the blob before answering, so that missing bytes are a clear error, not a cut stream
        first = next(chunks, b"")
    except FileNotFoundError as exc:
        raise APIError(404, f"The stored bytes of file '{file_id}' are missing.", code="file_content_missing",
                       param="file_id") from exc
    return StreamingResponse(itertools.chain([first], chunks), media_type="application/octet-stream",
                             headers={"Content-Length": str(row.bytes)})
