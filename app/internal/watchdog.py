"""A job never stays running without a live worker: jobs whose worker stopped heartbeating go
back to the queue, from the last saved training state, and are sent to the broker again."""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import utcnow
from app.core.queue import JobQueue
from app.internal.service import release_lease
from app.jobs import pipeline
from app.jobs.models import Job
from app.jobs.state import JobStatus, transition

log = logging.getLogger(__name__)


def _requeue(session: Session, job: Job) -> None:
    transition(session, job, JobStatus.QUEUED, level="warn",
               message=f"Worker {job.lease_owner or 'unknown'} stopped sending heartbeats; "
                       f"job re-queued from step {job.completed_steps}")


def expire_leases(session_factory: sessionmaker[Session], queue: JobQueue, *, now: datetime | None = None) -> list[str]:
    """Re-queue running jobs whose lease expired (or that have none) and clear expired leases of
    jobs in any other status; return the ids of the re-queued jobs."""
    now = now or utcnow()
    lease_over = or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < now)
    running = Job.status == JobStatus.RUNNING.value
    stale = or_(running & lease_over, Job.lease_expires_at < now)
    requeued: list[str] = []
    with session_factory.begin() as session:
        # SKIP LOCKED: a job being claimed or heartbeating right now is looked at next round.
        for job in session.scalars(select(Job).where(stale).with_for_update(skip_locked=True)):
            if job.status == JobStatus.RUNNING.value:
                _requeue(session, job)
                requeued.append(job.id)
            release_lease(job, remember=False)
    for job_id in requeued:
        pipeline.send_to_workers(session_factory, queue, job_id)
    return requeued


class Watchdog(threading.Thread):
    """Runs `expire_leases` every `interval_s` seconds until stopped; an error is logged and the
    next round runs anyway."""

    def __init__(self, session_factory: sessionmaker[Session], queue: JobQueue, interval_s: float) -> None:
        super().__init__(name="lease-watchdog", daemon=True)
        self.session_factory, self.queue, self.interval_s = session_factory, queue, interval_s
        self._stopped = threading.Event()

    def round(self) -> list[str]:
        """One pass; returns the ids re-queued (subclasses watch other objects the same way)."""
        return expire_leases(self.session_factory, self.queue)

    def run(self) -> None:
        while not self._stopped.is_set():
            try:
                requeued = self.round()
                if requeued:
                    log.warning("re-queued %s whose worker stopped heartbeating", ", ".join(requeued))
            except Exception:  # noqa: BLE001 - the watchdog must outlive a database or broker outage
                log.exception("lease watchdog round failed")
            self._stopped.wait(self.interval_s)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self.join(timeout)
