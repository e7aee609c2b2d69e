"""Files: stored bytes plus a row that says what they are. Scoped to a project."""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import unix
from app.core.errors import APIError, conflict, not_found
from agent_rft.ids import new_id
from app.core.input_limits import PROBLEM_MESSAGES, text_problem
from app.core.pagination import ListPage, page
from app.files.models import StoredFile
from app.files.schemas import FileObject
from app.files.storage import Storage, StoredBlob, TooLarge
from app.idempotency import service as idempotency

ACCEPTED_PURPOSES = ("fine-tune", "evals")  # training data; an eval run's items
RESULTS_PURPOSE = "fine-tune-results"  # files this service writes (a job's results); never uploaded
KNOWN_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
ENDPOINT = "POST /v1/files"


def to_schema(row: StoredFile) -> FileObject:
    return FileObject(
        id=row.id, bytes=row.bytes, created_at=unix(row.created_at), filename=row.filename,
        purpose=row.purpose, status=row.status,
    )


def check_purpose(purpose: str) -> None:
    if purpose not in ACCEPTED_PURPOSES:
        hint = "is not supported by this service" if purpose in KNOWN_PURPOSES else "is not a valid purpose"
        raise APIError(
            400, f"'{purpose}' {hint}; upload training data with purpose 'fine-tune' (an eval's items: 'evals').",
            code="invalid_value", param="purpose",
        )


def check_filename(filename: str | None) -> None:
    """A file name is stored as text, which cannot hold a NUL or a surrogate (app.core.input_limits
    leaves multipart bodies unread, so the part's name is checked here)."""
    if filename and (kind := text_problem(filename)) is not None:
        raise APIError(400, f"Invalid value for 'file': its file name {PROBLEM_MESSAGES[kind]}.", code="invalid_value",
                       param="file")


def store_upload(storage: Storage, source: BinaryIO, *, max_bytes: int) -> StoredBlob:
    key = new_id("blob_", 32)
    try:
        return storage.save(key, source, max_bytes=max_bytes)
    except TooLarge as exc:
        raise APIError(413, f"File is larger than the {exc.limit}-byte upload limit.", code="file_too_large", param="file") from exc


def create_file(
    *, session: Session, storage: Storage, project_id: str, blob: StoredBlob, filename: str, purpose: str,
    idempotency_key: str | None,
) -> FileObject:
    request_hash = idempotency.hash_json({"sha256": blob.sha256, "filename": filename, "purpose": purpose})
    replay = idempotency.claim(session, project_id=project_id, key=idempotency_key, endpoint=ENDPOINT, request_hash=request_hash)
    if replay is not None:
        storage.delete(blob.key)
        return get_file(session=session, project_id=project_id, file_id=replay)
    row = StoredFile(
        id=new_id("file-"), project_id=project_id, filename=filename, purpose=purpose, bytes=blob.size,
        sha256=blob.sha256, storage_key=blob.key, status="processed",
    )
    session.add(row)
    session.flush()
    idempotency.complete(session, project_id=project_id, key=idempotency_key, object_id=row.id)
    return to_schema(row)


def create_generated_file(
    *, session: Session, storage: Storage, project_id: str, filename: str, purpose: str, content: bytes
) -> FileObject:
    """A file this service writes itself. The bytes are stored first, then the row is added to the
    caller's transaction: a crash or a rollback leaves at worst unreferenced bytes, never a row
    without its bytes. (They are not deleted on rollback: a commit whose answer was lost may have
    happened.)"""
    blob = storage.save(new_id("blob_", 32), io.BytesIO(content), max_bytes=len(content))
    row = StoredFile(
        id=new_id("file-"), project_id=project_id, filename=filename, purpose=purpose, bytes=blob.size,
        sha256=blob.sha256, storage_key=blob.key, status="processed",
    )
    session.add(row)
    session.flush()
    return to_schema(row)


def _row(session: Session, file_id: str, *scope: Any) -> StoredFile:
    row = session.scalar(select(StoredFile).where(StoredFile.id == file_id, *scope))
    if row is None:
        raise not_found("file", file_id, param="file_id")
    return row


def get_row(*, session: Session, project_id: str, file_id: str) -> StoredFile:
    return _row(session, file_id, StoredFile.project_id == project_id)


def get_row_for_worker(*, session: Session, file_id: str) -> StoredFile:
    """Any project's file: workers serve every project."""
    return _row(session, file_id)


def get_file(*, session: Session, project_id: str, file_id: str) -> FileObject:
    return to_schema(get_row(session=session, project_id=project_id, file_id=file_id))


def list_files(
    *, session: Session, project_id: str, after: str | None, limit: int, order: str, purpose: str | None
) -> ListPage[FileObject]:
    stmt = select(StoredFile).where(StoredFile.project_id == project_id)
    if purpose:
        stmt = stmt.where(StoredFile.purpose == purpose)
    rows, has_more = page(session, stmt, StoredFile, after=after, limit=limit, descending=order == "desc")
    data = [to_schema(r) for r in rows]
    return ListPage[FileObject].of(data, has_more)


def delete_file(*, session: Session, project_id: str, file_id: str) -> str:
    """Delete the row; return the storage key, to be removed once the transaction commits."""
    from app.jobs.service import active_job_using_file  # jobs depend on files, not the reverse

    row = get_row(session=session, project_id=project_id, file_id=file_id)
    job_id = active_job_using_file(session=session, project_id=project_id, file_id=file_id)
    if job_id is not None:
        raise conflict(
            f"File '{file_id}' is used by job '{job_id}', which has not finished; cancel the job first.",
            code="file_in_use", param="file_id",
        )
    session.delete(row)
    session.flush()
    return row.storage_key
