"""A diagnostic never stays running without a live worker: one whose worker stopped
heartbeating goes back to the queue (and, unless a job runs it, to the broker); the next worker
skips the samples already stored. A job's diagnostic left behind by a job that ended is cancelled.
The lease rules and the loop are app/core/lifecycle's, as for jobs."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import utcnow
from app.core.lifecycle import expire_leases
from app.core.queue import JobQueue
from app.diagnostics import pipeline
from app.diagnostics.models import Diagnostic
from app.diagnostics.state import ACTIVE, DiagnosticStatus, transition
from app.jobs.models import Job
from app.jobs.state import TERMINAL as JOB_TERMINAL

S = DiagnosticStatus


def expire_diagnostic_leases(factory: sessionmaker[Session], queue: JobQueue, *,
                             now: datetime | None = None, restart_grace_s: float | None = None) -> list[str]:
    """Re-queue running diagnostics whose lease expired; return the ids sent to the broker again
    (a job's diagnostic is not sent: the job's next worker runs it). `restart_grace_s`: the first round
    after the API starts (app/core/lifecycle.expire_leases)."""

    def requeue(diagnostic: Diagnostic) -> bool:
        transition(session, diagnostic, S.QUEUED)
        return diagnostic.job_id is None

    with factory.begin() as session:
        resend = expire_leases(session, Diagnostic, now=now or utcnow(), requeue=requeue, restart_grace_s=restart_grace_s)
        orphans = select(Diagnostic).join(Job, Job.id == Diagnostic.job_id).where(
            Diagnostic.status.in_([s.value for s in ACTIVE]), Job.status.in_([s.value for s in JOB_TERMINAL]))
        for diagnostic in session.scalars(orphans.with_for_update(skip_locked=True, of=Diagnostic)):
            transition(session, diagnostic, S.CANCELLED)
    for diagnostic_id in resend:
        pipeline.send_to_workers(factory, queue, diagnostic_id)
    return resend
