"""The diagnostic's state machine: the only place a diagnostic's status changes."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from app.core.db import utcnow
from app.core.errors import conflict
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
# Only the control plane makes this move: a running diagnostic whose worker's lease expired goes
# back to the queue, and the next worker carries on from the samples already stored.
SYSTEM_TRANSITIONS: dict[DiagnosticStatus, frozenset[DiagnosticStatus]] = {S.RUNNING: frozenset({S.QUEUED})}


def transition(diagnostic: Diagnostic, to: DiagnosticStatus, *, action: str | None = None,
               error: dict[str, Any] | None = None) -> None:
    current = DiagnosticStatus(diagnostic.status)
    allowed = TRANSITIONS.get(current, frozenset())
    if action is None:
        allowed |= SYSTEM_TRANSITIONS.get(current, frozenset())
    if to not in allowed:
        verb = action or f"move to '{to.value}'"
        raise conflict(f"Cannot {verb} diagnostic '{diagnostic.id}': its status is '{current.value}'.",
                       code="invalid_diagnostic_status", param="status")
    diagnostic.status = to.value
    if to == S.RUNNING and diagnostic.started_at is None:
        diagnostic.started_at = utcnow()
    if to in TERMINAL:
        diagnostic.finished_at = utcnow()
    if error is not None:
        diagnostic.error = error
    if to == S.QUEUED:
        diagnostic.enqueued_at = None  # (re)sent to the broker after the commit
