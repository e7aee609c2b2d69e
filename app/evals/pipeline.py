"""An eval run between creation and a worker, and back: sent to the broker after its creation
is committed (again at start-up when the broker was down), and re-queued by the watchdog when its
worker stops heartbeating; the next worker carries on from the output items already stored."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import utcnow
from app.core.lifecycle import expire_leases, hand_to_broker
from app.core.queue import JobQueue
from app.evals.models import EvalRun
from app.evals.state import RunStatus, transition

S = RunStatus


def send_to_workers(factory: sessionmaker[Session], queue: JobQueue, run_id: str) -> bool:
    return hand_to_broker(factory, EvalRun, run_id, queue.enqueue_eval_run)


def recover(factory: sessionmaker[Session], queue: JobQueue) -> None:
    """At start-up: send the queued runs a previous process could not hand to the broker."""
    with factory() as session:
        unsent = list(session.scalars(select(EvalRun.id).where(EvalRun.status == S.QUEUED.value,
                                                               EvalRun.enqueued_at.is_(None))))
    for run_id in unsent:
        send_to_workers(factory, queue, run_id)


def expire_run_leases(factory: sessionmaker[Session], queue: JobQueue, *, now: datetime | None = None,
                      restart_grace_s: float | None = None) -> list[str]:
    """Re-queue running eval runs whose lease expired and send them again (app/core/lifecycle.expire_leases)."""

    def requeue(run: EvalRun) -> bool:
        transition(session, run, S.QUEUED)
        return True

    with factory.begin() as session:
        resend = expire_leases(session, EvalRun, now=now or utcnow(), requeue=requeue, restart_grace_s=restart_grace_s)
    for run_id in resend:
        send_to_workers(factory, queue, run_id)
    return resend
