"""A job never stays running without a live worker: jobs whose worker stopped heartbeating go
back to the queue, from the last saved training state, and are sent to the broker again
(app/core/lifecycle.expire_leases; the loop is app/core/lifecycle.PeriodicLoop)."""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from app.core.db import utcnow
from app.core.lifecycle import expire_leases
from app.core.queue import JobQueue
from app.jobs import pipeline
from app.jobs.models import Job
from app.jobs.state import JobStatus, transition
from app.observability.registry import LEASE_EXPIRIES

log = logging.getLogger(__name__)


def expire_job_leases(session_factory: sessionmaker[Session], queue: JobQueue, *,
                      now: datetime | None = None, restart_grace_s: float | None = None) -> list[str]:
    """Re-queue running jobs whose lease expired (or that have none) and clear expired leases of
    jobs in any other status; return the ids of the re-queued jobs, sent to the broker again.
    `restart_grace_s`: the first round after the API starts (app/core/lifecycle.expire_leases)."""

    def requeue(job: Job) -> bool:
        transition(session, job, JobStatus.QUEUED, level="warn",
                   message=f"Worker {job.lease_owner or 'unknown'} stopped sending heartbeats; "
                           f"job re-queued from step {job.completed_steps}")
        return True

    with session_factory.begin() as session:
        requeued = expire_leases(session, Job, now=now or utcnow(), requeue=requeue, restart_grace_s=restart_grace_s)
    LEASE_EXPIRIES.inc(len(requeued))  # counted once the re-queue is committed
    for job_id in requeued:
        pipeline.send_to_workers(session_factory, queue, job_id)
    if requeued:
        log.warning("re-queued %s whose worker stopped heartbeating", ", ".join(requeued))
    return requeued
