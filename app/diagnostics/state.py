"""The diagnostic's state machine (app/core/lifecycle.StateMachine): the only place a
diagnostic's status changes."""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.lifecycle import StateMachine
from app.diagnostics.models import Diagnostic


class DiagnosticStatus(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = DiagnosticStatus
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
ACTIVE = frozenset({S.VALIDATING_FILES, S.QUEUED, S.RUNNING})

TRANSITIONS: dict[DiagnosticStatus, frozenset[DiagnosticStatus]] = {
    S.VALIDATING_FILES: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
    S.QUEUED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED}),
}


def _on_move(_session: Session, diagnostic: Diagnostic, _previous: DiagnosticStatus, to: DiagnosticStatus) -> None:
    if to == S.RUNNING and diagnostic.started_at is None:
        diagnostic.started_at = utcnow()


# Only the control plane makes the system move: a running diagnostic whose worker's lease expired
# goes back to the queue, and the next worker carries on from the samples already stored.
DIAGNOSTIC_STATES = StateMachine("diagnostic", TRANSITIONS, TERMINAL,
                                 system_transitions={S.RUNNING: frozenset({S.QUEUED})}, on_move=_on_move)
# transition(session, diagnostic, to, *, action=None, error=None)
transition = DIAGNOSTIC_STATES.move
