"""What happens to a job between creation and a worker: file validation (in the API process,
off the request) and the hand-off to the broker. Both recover after a restart."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import BackgroundTasks, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.core.deps import after_response
from app.core.queue import JobQueue
from app.files.models import StoredFile
from app.files.storage import Storage
from app.jobs import service
from app.jobs.models import Job
from app.jobs.state import JobStatus, add_event, transition
from app.jobs.validation import FileReport, validate_jsonl

log = logging.getLogger(__name__)


def _file_report(session: Session, storage: Storage, project_id: str, file_id: str,
                 declared: set[str], method_type: str) -> FileReport | str:
    row = session.scalar(select(StoredFile).where(StoredFile.id == file_id, StoredFile.project_id == project_id))
    if row is None:
        return f"file '{file_id}' no longer exists"
    try:
        with storage.open(row.storage_key) as fh:
            return validate_jsonl(fh, declared_tools=declared, method_type=method_type)
    except FileNotFoundError:
        return f"the stored bytes of file '{file_id}' are missing"


def _failure(param: str, file_id: str, report: FileReport | str, min_rows: int) -> dict[str, Any] | None:
    if isinstance(report, str):
        return {"code": "file_unavailable", "message": f"{param} {report}.", "param": param}
    if report.errors:
        shown = "; ".join(f"line {e.line}: {e.message}" for e in report.errors)
        more = report.error_count - len(report.errors)
        suffix = f"; and {more} more invalid line{'s' if more != 1 else ''}" if more else ""
        return {
            "code": report.errors[0].code,
            "message": f"{param} '{file_id}' has {report.error_count} invalid line{'s' if report.error_count != 1 else ''}: {shown}{suffix}.",
            "param": param,
        }
    if report.rows < min_rows:
        return {
            "code": "too_few_rows",
            "message": f"{param} '{file_id}' has {report.rows} row{'s' if report.rows != 1 else ''}; at least {min_rows} are required.",
            "param": param,
        }
    return None


def validate_job_files(session: Session, storage: Storage, job: Job, *, min_rows: int) -> dict[str, Any] | None:
    declared = {t["name"] for t in (job.method.get("reinforcement") or {}).get("tools", [])}
    files = [("training_file", job.training_file, min_rows)]
    if job.validation_file:
        files.append(("validation_file", job.validation_file, 1))
    for param, file_id, rows_needed in files:
        failure, rows = check_file_rows(session, storage, project_id=job.project_id, param=param, file_id=file_id,
                                        declared_tools=declared, min_rows=rows_needed, method_type=job.method["type"])
        if failure:
            return failure
        add_event(session, job, f"{param} '{file_id}' is valid: {rows} row{'s' if rows != 1 else ''}.")
    return None


def check_file_rows(session: Session, storage: Storage, *, project_id: str, param: str, file_id: str,
                    declared_tools: set[str], min_rows: int,
                    method_type: str = "reinforcement") -> tuple[dict[str, Any] | None, int]:
    """Every line of a stored JSONL file checked, as rows of `method_type`: (the error to report or
    None, valid rows). Jobs and variance diagnostics validate their files with this."""
    report = _file_report(session, storage, project_id, file_id, declared_tools, method_type)
    failure = _failure(param, file_id, report, min_rows)
    return failure, (0 if isinstance(report, str) else report.rows)


def run_validation(factory: sessionmaker[Session], storage: Storage, queue: JobQueue, job_id: str, *, min_rows: int) -> None:
    """Validate a job's files and queue it, or fail it with the first errors."""
    with factory() as session:
        job = session.scalar(select(Job).where(Job.id == job_id).with_for_update())
        if job is None or job.status != JobStatus.VALIDATING_FILES.value:
            return  # cancelled meanwhile, or already handled by another process
        try:
            failure = validate_job_files(session, storage, job, min_rows=min_rows)
        except Exception as exc:  # noqa: BLE001 - a validation bug must fail the job, not leave it hanging
            log.exception("validation of %s crashed", job_id)
            failure = {"code": "validation_error", "message": f"Validation could not complete: {exc}", "param": None}
        if failure:
            transition(session, job, JobStatus.FAILED, level="error", error=failure,
                       message=f"Validation failed: {failure['message']}")
        else:
            transition(session, job, JobStatus.QUEUED, message="Files validated; job queued for training.")
        session.commit()
    if not failure:
        send_to_workers(factory, queue, job_id)


def send_to_workers(factory: sessionmaker[Session], queue: JobQueue, job_id: str) -> bool:
    """Publish the job's task after its status is committed; record success. On a broker
    failure the job stays queued without `enqueued_at`, and start-up sends it again."""
    try:
        task_id = queue.enqueue_job(job_id)
    except Exception as exc:  # noqa: BLE001 - any broker failure is reported, never raised into a request
        log.warning("could not enqueue %s: %s", job_id, exc)
        with factory.begin() as session:
            job = session.scalar(select(Job).where(Job.id == job_id))
            if job is not None:
                add_event(session, job, f"Could not reach the broker; the job will be sent again when the server restarts ({exc}).",
                          level="warn")
        return False
    with factory.begin() as session:
        service.mark_enqueued(session=session, job_id=job_id)
        job = session.scalar(select(Job).where(Job.id == job_id))
        if job is not None:
            add_event(session, job, "Job sent to the training queue.", data={"task_id": task_id})
    return True


def send_after_response(background: BackgroundTasks, request: Request, job_id: str) -> None:
    """Hand the job to the broker once the response, and so the commit of its status, is done."""
    state = request.app.state
    after_response(background, request, send_to_workers, state.session_factory, state.queue, job_id)


def recover(factory: sessionmaker[Session], storage: Storage, queue: JobQueue, *, min_rows: int) -> None:
    """At start-up: finish validations and hand-offs that a previous process left half done."""
    with factory() as session:
        validating = list(session.scalars(select(Job.id).where(Job.status == JobStatus.VALIDATING_FILES.value)))
        unsent = list(session.scalars(
            select(Job.id).where(Job.status == JobStatus.QUEUED.value, Job.enqueued_at.is_(None))
        ))
    for job_id in validating:
        run_validation(factory, storage, queue, job_id, min_rows=min_rows)
    for job_id in unsent:
        send_to_workers(factory, queue, job_id)
