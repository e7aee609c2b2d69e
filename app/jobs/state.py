"""The job state machine (app/core/lifecycle.StateMachine): the only place a job's status
changes. Every change writes an event and the webhook outbox row."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from agent_rft.ids import new_id
from app.core.lifecycle import StateMachine
from app.jobs.models import Job, JobEvent
from app.webhooks import outbox


class JobStatus(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = JobStatus
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
ACTIVE = frozenset({S.VALIDATING_FILES, S.QUEUED, S.RUNNING, S.PAUSED})

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.VALIDATING_FILES: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
    S.QUEUED: frozenset({S.RUNNING, S.PAUSED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.PAUSED, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.PAUSED: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
}

# User actions and the status each one moves a job to.
ACTIONS: dict[str, JobStatus] = {"pause": S.PAUSED, "resume": S.QUEUED, "cancel": S.CANCELLED}


def add_event(
    session: Session, job: Job, message: str, *, level: str = "info", type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    event = JobEvent(id=new_id("ftevent-"), job_id=job.id, level=level, type=type, message=message, data=data)
    session.add(event)
    return event


def _on_move(session: Session, job: Job, previous: JobStatus, to: JobStatus, *, message: str,
             level: str = "info") -> None:
    add_event(session, job, message, level=level, data={"status": to.value, "previous_status": previous.value})
    # Webhook events (succeeded, failed, cancelled, paused) are written in this same transaction.
    outbox.job_status_changed(session, project_id=job.project_id, job_id=job.id, status=to.value)


# Moves only the control plane makes, never a user action: a running job whose worker's lease
# expired, or whose worker stopped for a pause that was withdrawn meanwhile, goes back to the queue;
# a paused job resumed while its worker still holds the lease (it has not stopped for the pause)
# runs on with that worker (app/jobs/service.apply_action). "resume" of a running job stays refused.
JOB_STATES = StateMachine("job", TRANSITIONS, TERMINAL,
                          system_transitions={S.RUNNING: frozenset({S.QUEUED}), S.PAUSED: frozenset({S.RUNNING})},
                          on_move=_on_move)
# transition(session, job, to, *, message, action=None, level="info", error=None)
transition = JOB_STATES.move
