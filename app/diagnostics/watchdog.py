"""A diagnostic never stays running without a live worker: one whose worker stopped
heartbeating goes back to the queue (and, unless a job runs it, to the broker); the next worker
skips the samples already stored. A job's diagnostic left behind by a job that ended is cancelled."""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import utcnow
from app.core.queue import JobQueue
from app.diagnostics import pipeline
from app.diagnostics.models import Diagnostic
from app.diagnostics.state import ACTIVE, DiagnosticStatus, transition
from app.internal.service import release_lease
from app.internal.watchdog import Watchdog
from app.jobs.models import Job
from app.jobs.state import TERMINAL as JOB_TERMINAL

log = logging.getLogger(__name__)
S = DiagnosticStatus


def expire_leases(factory: sessionmaker[Session], queue: JobQueue, *, now: datetime | None = None) -> list[str]:
    """Re-queue running diagnostics whose lease expired; return the ids sent to the broker again."""
    now = now or utcnow()
    lease_over = or_(Diagnostic.lease_expires_at.is_(None), Diagnostic.lease_expires_at < now)
    stale = or_((Diagnostic.status == S.RUNNING.value) & lease_over, Diagnostic.lease_expires_at < now)
    resend: list[str] = []
    with factory.begin() as session:
        for diagnostic in session.scalars(select(Diagnostic).where(stale).with_for_update(skip_locked=True)):
            if diagnostic.status == S.RUNNING.value:
                transition(diagnostic, S.QUEUED)
                if diagnostic.job_id is None:
                    resend.append(diagnostic.id)
            release_lease(diagnostic, remember=False)
        orphans = select(Diagnostic).join(Job, Job.id == Diagnostic.job_id).where(
            Diagnostic.status.in_([s.value for s in ACTIVE]), Job.status.in_([s.value for s in JOB_TERMINAL]))
        for diagnostic in session.scalars(orphans.with_for_update(skip_locked=True, of=Diagnostic)):
            transition(diagnostic, S.CANCELLED)
    for diagnostic_id in resend:
        pipeline.send_to_workers(factory, queue, diagnostic_id)
    return resend


class DiagnosticWatchdog(Watchdog):
    """The jobs' watchdog loop, over diagnostics."""

    def __init__(self, session_factory: sessionmaker[Session], queue: JobQueue, interval_s: float) -> None:
        super().__init__(session_factory, queue, interval_s)
        self.name = "diagnostic-watchdog"

    def round(self) -> list[str]:
        return expire_leases(self.session_factory, self.queue)
