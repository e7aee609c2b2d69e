"""A diagnostic between creation and a worker: its training file is validated with the jobs'
own checks (in the API process, off the request), then it is sent to the workers. Both recover
after a restart. Diagnostics that a job runs are never sent: the job's worker runs them."""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.core.lifecycle import hand_to_broker
from app.core.queue import JobQueue
from app.diagnostics.models import Diagnostic
from app.diagnostics.state import DiagnosticStatus, transition
from app.files.storage import Storage
from app.jobs.pipeline import check_file_rows

log = logging.getLogger(__name__)
S = DiagnosticStatus


def run_validation(factory: sessionmaker[Session], storage: Storage, queue: JobQueue, diagnostic_id: str) -> None:
    with factory() as session:
        diagnostic = session.scalar(select(Diagnostic).where(Diagnostic.id == diagnostic_id).with_for_update())
        if diagnostic is None or diagnostic.status != S.VALIDATING_FILES.value:
            return  # cancelled meanwhile, or already handled by another process
        declared = {t["name"] for t in (diagnostic.method.get("reinforcement") or {}).get("tools", [])}
        try:
            failure, rows = check_file_rows(session, storage, project_id=diagnostic.project_id, param="training_file",
                                            file_id=diagnostic.training_file, declared_tools=declared, min_rows=1)
        except Exception as exc:  # noqa: BLE001 - a validation bug must fail the diagnostic, not leave it hanging
            log.exception("validation of %s crashed", diagnostic_id)
            failure, rows = {"code": "validation_error", "message": f"Validation could not complete: {exc}",
                             "param": None}, 0
        if failure:
            transition(session, diagnostic, S.FAILED, error=failure)
        else:
            diagnostic.samples_total = min(rows, diagnostic.max_samples or rows)
            transition(session, diagnostic, S.QUEUED)
        session.commit()
    if not failure:
        send_to_workers(factory, queue, diagnostic_id)


def send_to_workers(factory: sessionmaker[Session], queue: JobQueue, diagnostic_id: str) -> bool:
    return hand_to_broker(factory, Diagnostic, diagnostic_id, queue.enqueue_diagnostic)


def recover(factory: sessionmaker[Session], storage: Storage, queue: JobQueue) -> None:
    """At start-up: finish validations and hand-offs that a previous process left half done."""
    with factory() as session:
        validating = list(session.scalars(select(Diagnostic.id).where(
            Diagnostic.status == S.VALIDATING_FILES.value)))
        unsent = list(session.scalars(select(Diagnostic.id).where(
            Diagnostic.status == S.QUEUED.value, Diagnostic.enqueued_at.is_(None), Diagnostic.job_id.is_(None))))
    for diagnostic_id in validating:
        run_validation(factory, storage, queue, diagnostic_id)
    for diagnostic_id in unsent:
        send_to_workers(factory, queue, diagnostic_id)
