"""An eval run's state machine (app/core/lifecycle.StateMachine), in the lifecycle's words; the
API shows OpenAI's (`PUBLIC_STATUS`)."""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.lifecycle import StateMachine
from app.evals.models import EvalRun


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = RunStatus
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
PUBLIC_STATUS = {S.QUEUED: "queued", S.RUNNING: "in_progress", S.SUCCEEDED: "completed", S.FAILED: "failed",
                 S.CANCELLED: "canceled"}
FROM_PUBLIC = {public: status for status, public in PUBLIC_STATUS.items()}

TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    S.QUEUED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED}),
}


def _on_move(_session: Session, run: EvalRun, _previous: RunStatus, to: RunStatus) -> None:
    if to == S.RUNNING and run.started_at is None:
        run.started_at = utcnow()


# The system move: a running run whose worker's lease expired goes back to the queue, and the next
# worker carries on from the output items already stored.
RUN_STATES = StateMachine("eval_run", TRANSITIONS, TERMINAL, system_transitions={S.RUNNING: frozenset({S.QUEUED})},
                          on_move=_on_move)
transition = RUN_STATES.move


def public_status(status: str) -> str:
    return PUBLIC_STATUS[RunStatus(status)]
