"""Variance diagnostics: creation (with the job's own checks), reading, cancel, the rollouts
listing, and the results computed from the stored rollouts. The worker side is worker_service.py."""

from __future__ import annotations

import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.db import unix
from app.core.errors import conflict, not_found
from agent_rft.ids import new_id
from app.core.pagination import ListPage, page, page_by
from app.diagnostics import summary as summaries
from app.diagnostics.models import Diagnostic, DiagnosticRollout
from app.diagnostics.schemas import (
    DiagnosticCreate,
    DiagnosticObject,
    DiagnosticProgress,
    DiagnosticRolloutObject,
)
from app.diagnostics.state import TERMINAL, DiagnosticStatus, transition
from app.idempotency import service as idempotency
from app.jobs import service as jobs
from app.jobs.schemas import JobError

S = DiagnosticStatus
ENDPOINT = "POST /v1/fine_tuning/alpha/diagnostics"


# --- public objects -------------------------------------------------------------------------

def to_schema(diagnostic: Diagnostic, *, with_samples: bool = True) -> DiagnosticObject:
    result = diagnostic.result or {}
    total = diagnostic.samples_total
    return DiagnosticObject(
        id=diagnostic.id, created_at=unix(diagnostic.created_at), started_at=unix(diagnostic.started_at),
        finished_at=unix(diagnostic.finished_at), status=diagnostic.status,
        error=JobError(**diagnostic.error) if diagnostic.error else None, organization_id=diagnostic.project_id,
        model=diagnostic.model, training_file=diagnostic.training_file,
        method=jobs.public_method(diagnostic.method), runs_per_sample=diagnostic.runs_per_sample,
        max_samples=diagnostic.max_samples, non_read_only_tools=diagnostic.non_read_only_tools,
        seed=diagnostic.seed, metadata=diagnostic.user_metadata,
        fine_tuning_job_id=diagnostic.job_id,
        progress=DiagnosticProgress(
            samples_done=diagnostic.samples_done, samples_total=total, rollouts_done=diagnostic.rollouts_done,
            rollouts_total=total * diagnostic.runs_per_sample if total is not None else None),
        summary=result.get("summary"), verdict=result.get("verdict"),
        samples=result.get("samples") if with_samples else None,
    )


def create(*, session: Session, settings: Settings, project_id: str, body: DiagnosticCreate,
           idempotency_key: str | None) -> tuple[DiagnosticObject, bool]:
    """Returns the diagnostic and whether it is new (False: replayed for a repeated Idempotency-Key)."""
    request_hash = idempotency.hash_json(body.model_dump(mode="json", exclude_unset=True))
    replay = idempotency.claim(session, project_id=project_id, key=idempotency_key, endpoint=ENDPOINT,
                               request_hash=request_hash)
    if replay is not None:
        return get(session=session, project_id=project_id, diagnostic_id=replay), False
    # A diagnostic measures the reward variance of rollouts: a reinforcement method's only.
    method = jobs.check_method(body.method, settings, supported=("reinforcement",))
    jobs.check_file(session, project_id, body.training_file, "training_file")
    diagnostic = Diagnostic(
        id=new_id("diag-"), project_id=project_id, model=body.model, training_file=body.training_file,
        method=method, runs_per_sample=body.runs_per_sample, max_samples=body.max_samples,
        non_read_only_tools=body.non_read_only_tools,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31 - 1), user_metadata=body.metadata,
        status=S.VALIDATING_FILES.value,
    )
    session.add(diagnostic)
    session.flush()
    idempotency.complete(session, project_id=project_id, key=idempotency_key, object_id=diagnostic.id)
    return to_schema(diagnostic), True


def get_row(*, session: Session, project_id: str, diagnostic_id: str, for_update: bool = False) -> Diagnostic:
    stmt = select(Diagnostic).where(Diagnostic.id == diagnostic_id, Diagnostic.project_id == project_id)
    if for_update:
        stmt = stmt.with_for_update()
    diagnostic = session.scalar(stmt)
    if diagnostic is None:
        raise not_found("diagnostic", diagnostic_id, param="diagnostic_id")
    return diagnostic


def get(*, session: Session, project_id: str, diagnostic_id: str) -> DiagnosticObject:
    return to_schema(get_row(session=session, project_id=project_id, diagnostic_id=diagnostic_id))


def list_page(*, session: Session, project_id: str, after: str | None, limit: int) -> ListPage[DiagnosticObject]:
    rows, has_more = page(session, select(Diagnostic).where(Diagnostic.project_id == project_id), Diagnostic,
                          after=after, limit=limit)
    return ListPage[DiagnosticObject].of([to_schema(r, with_samples=False) for r in rows], has_more)


def cancel(*, session: Session, project_id: str, diagnostic_id: str) -> DiagnosticObject:
    diagnostic = get_row(session=session, project_id=project_id, diagnostic_id=diagnostic_id, for_update=True)
    if diagnostic.job_id is not None and diagnostic.status not in {s.value for s in TERMINAL}:
        raise conflict(f"Diagnostic '{diagnostic.id}' runs before job '{diagnostic.job_id}'; cancel the job instead.",
                       code="diagnostic_owned_by_job", param="diagnostic_id")
    transition(session, diagnostic, S.CANCELLED, action="cancel")
    refresh_result(session, diagnostic)  # what was run so far stays readable
    return to_schema(diagnostic)


def list_rollouts(*, session: Session, project_id: str, diagnostic_id: str, sample_index: int | None,
                  after: str | None, limit: int) -> ListPage[DiagnosticRolloutObject]:
    """Ordered by sample, then run; `after` is the id (trace_id) of the last rollout of the previous page."""
    get_row(session=session, project_id=project_id, diagnostic_id=diagnostic_id)
    stmt = select(DiagnosticRollout).where(DiagnosticRollout.diagnostic_id == diagnostic_id)
    if sample_index is not None:
        stmt = stmt.where(DiagnosticRollout.sample_index == sample_index)
    rows, has_more = page_by(session, stmt, order=(DiagnosticRollout.sample_index, DiagnosticRollout.run_index),
                             cursor=DiagnosticRollout.trace_id, after=after, limit=limit, descending=False,
                             noun="rollout")
    data = [DiagnosticRolloutObject(id=r.trace_id, sample_index=r.sample_index, run_index=r.run_index,
                                    reward=r.reward, finish_reason=r.finish_reason, tool_calls=r.tool_calls,
                                    data=r.data) for r in rows]
    return ListPage[DiagnosticRolloutObject].of(data, has_more)


# --- results --------------------------------------------------------------------------------

def refresh_result(session: Session, diagnostic: Diagnostic) -> None:
    """Recompute samples, summary and verdict from every stored rollout."""
    session.flush()
    rows = session.execute(select(
        DiagnosticRollout.sample_index, DiagnosticRollout.run_index, DiagnosticRollout.trace_id,
        DiagnosticRollout.reward, DiagnosticRollout.finish_reason, DiagnosticRollout.data,
    ).where(DiagnosticRollout.diagnostic_id == diagnostic.id)).mappings().all()
    if not rows and diagnostic.status != S.SUCCEEDED.value:
        return
    diagnostic.result = summaries.build_result(rows, runs_per_sample=diagnostic.runs_per_sample,
                                               load_basis=diagnostic.load_basis)
