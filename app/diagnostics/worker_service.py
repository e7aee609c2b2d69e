"""The worker side of a variance diagnostic (`/internal/v1/diagnostics/...`): claim under a
lease like a job's (app/core/lifecycle.py), heartbeat, pushes of graded runs, finish; and the
diagnostic a job's worker asks for before training."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.db import storable_json, unix, utcnow
from app.core.errors import bad_request, not_found
from agent_rft.ids import new_id
from app.core.lifecycle import claim_run, end_run, leased_run, locked_run
from app.core.worker_schemas import HeartbeatResponse
from app.diagnostics import service
from app.diagnostics.models import Diagnostic, DiagnosticRollout
from app.diagnostics.schemas import DiagnosticObject
from app.diagnostics.worker_schemas import (
    ClaimedDiagnostic,
    DiagnosticClaimResponse,
    DiagnosticFinishPush,
    DiagnosticFinishResult,
    DiagnosticRolloutPush,
    DiagnosticRolloutResult,
    JobDiagnostic,
)
from app.diagnostics.state import DIAGNOSTIC_STATES, DiagnosticStatus, transition
from app.jobs.models import Job
from app.jobs.schemas import OpenModelOptions
from app.jobs.state import ACTIVE as JOB_ACTIVE
from app.jobs.state import add_event
from app.jobs.tool_headers import open_headers
from app.jobs.worker_service import tool_call_count

S = DiagnosticStatus


def done_samples(session: Session, diagnostic: Diagnostic) -> list[int]:
    """Samples with every run stored: a worker that takes over skips them."""
    stmt = (select(DiagnosticRollout.sample_index).where(DiagnosticRollout.diagnostic_id == diagnostic.id)
            .group_by(DiagnosticRollout.sample_index)
            .having(func.count() >= diagnostic.runs_per_sample).order_by(DiagnosticRollout.sample_index))
    return list(session.scalars(stmt))


def claim(*, session: Session, settings: Settings, diagnostic_id: str, worker_id: str) -> DiagnosticClaimResponse:
    diagnostic = locked_run(session, Diagnostic, diagnostic_id)
    claim_run(diagnostic, worker_id, lease_seconds=settings.lease_seconds, now=utcnow(),
              start=lambda: transition(session, diagnostic, S.RUNNING))
    return DiagnosticClaimResponse(
        lease_id=diagnostic.lease_id, lease_expires_at=unix(diagnostic.lease_expires_at),
        diagnostic=ClaimedDiagnostic(
            id=diagnostic.id, project_id=diagnostic.project_id, job_id=diagnostic.job_id, model=diagnostic.model,
            training_file=diagnostic.training_file, method=open_headers(diagnostic.method, secret_box(settings)),
            runs_per_sample=diagnostic.runs_per_sample, max_samples=diagnostic.max_samples, seed=diagnostic.seed,
            non_read_only_tools=diagnostic.non_read_only_tools, done_samples=done_samples(session, diagnostic)))


def _job_is_over(session: Session, diagnostic: Diagnostic) -> bool:
    if diagnostic.job_id is None:
        return False
    status = session.scalar(select(Job.status).where(Job.id == diagnostic.job_id))
    return status not in {s.value for s in JOB_ACTIVE}


def heartbeat(*, session: Session, settings: Settings, diagnostic_id: str, lease_id: str) -> HeartbeatResponse:
    diagnostic = leased_run(session, Diagnostic, diagnostic_id, lease_id)
    diagnostic.extend_lease(settings.lease_seconds)
    stop = diagnostic.status == S.CANCELLED.value or _job_is_over(session, diagnostic)
    return HeartbeatResponse(action="cancel" if stop else "continue", lease_expires_at=unix(diagnostic.lease_expires_at))


def push_rollouts(*, session: Session, diagnostic_id: str, body: DiagnosticRolloutPush) -> DiagnosticRolloutResult:
    """Store new runs (a (sample, run) or trace id already stored is skipped) and the progress."""
    diagnostic = leased_run(session, Diagnostic, diagnostic_id, body.lease_id)
    if body.samples_total is not None:
        diagnostic.samples_total = body.samples_total
    if body.load_basis is not None:
        diagnostic.load_basis = body.load_basis
    records = [r.model_dump(mode="json") for r in body.records]
    known = session.execute(select(DiagnosticRollout.trace_id, DiagnosticRollout.sample_index,
                                   DiagnosticRollout.run_index)
                            .where(DiagnosticRollout.diagnostic_id == diagnostic_id)).all()
    traces, runs = {k.trace_id for k in known}, {(k.sample_index, k.run_index) for k in known}
    new = []
    for record in records:
        key = (record["sample_index"], record["run_index"])
        if record["trace_id"] in traces or key in runs:
            continue
        traces.add(record["trace_id"])
        runs.add(key)
        new.append({"diagnostic_id": diagnostic_id, "trace_id": record["trace_id"],
                    "sample_index": record["sample_index"], "run_index": record["run_index"],
                    "reward": storable_json(record.get("reward")), "finish_reason": record.get("finish_reason"),
                    "tool_calls": tool_call_count(record), "data": record})
    if new:
        session.execute(insert(DiagnosticRollout), new)
    diagnostic.rollouts_done = len(runs)
    diagnostic.samples_done = len(done_samples(session, diagnostic))
    return DiagnosticRolloutResult(stored=len(new), samples_done=diagnostic.samples_done,
                                   rollouts_done=diagnostic.rollouts_done)


def finish(*, session: Session, diagnostic_id: str, body: DiagnosticFinishPush) -> DiagnosticFinishResult:
    status = end_run(session, Diagnostic, diagnostic_id, body.lease_id, status=body.status,
                     error=body.error.model_dump() if body.error else None, states=DIAGNOSTIC_STATES,
                     refresh=lambda row: service.refresh_result(session, row))
    return DiagnosticFinishResult(status=status)


def worker_view(*, session: Session, diagnostic_id: str) -> DiagnosticObject:
    diagnostic = session.scalar(select(Diagnostic).where(Diagnostic.id == diagnostic_id))
    if diagnostic is None:
        raise not_found("diagnostic", diagnostic_id, param="diagnostic_id")
    return service.to_schema(diagnostic)


# --- a job's diagnostic -----------------------------------------------------------------------

def _job_options(job: Job) -> Any:
    options = OpenModelOptions.model_validate((job.method.get("reinforcement") or {}).get("x_open_model") or {})
    return options.diagnostic


def diagnostic_for_job(*, session: Session, job_id: str, lease_id: str) -> JobDiagnostic:
    """The diagnostic a job runs before training: the one it recorded unless that one was
    cancelled or failed (a paused and resumed job), else a new one, recorded on the job."""
    job = leased_run(session, Job, job_id, lease_id)
    options = _job_options(job)
    if options is None:
        raise bad_request(f"Job '{job_id}' has no x_open_model.diagnostic option.", param="job_id")
    if job.diagnostic_id:
        current = session.scalar(select(Diagnostic).where(Diagnostic.id == job.diagnostic_id))
        if current is not None and current.status not in (S.CANCELLED.value, S.FAILED.value):
            return JobDiagnostic(id=current.id, status=current.status, created=False)
    diagnostic = Diagnostic(
        id=new_id("diag-"), project_id=job.project_id, job_id=job.id, model=job.model,
        training_file=job.training_file, method=job.method, runs_per_sample=options.runs_per_sample,
        max_samples=options.max_samples, non_read_only_tools=options.non_read_only_tools, seed=job.seed,
        status=S.QUEUED.value,
    )
    session.add(diagnostic)
    session.flush()
    job.diagnostic_id = diagnostic.id
    add_event(session, job, f"Variance diagnostic {diagnostic.id} created: every sample runs "
                            f"{options.runs_per_sample} times before training.", data={"diagnostic_id": diagnostic.id})
    return JobDiagnostic(id=diagnostic.id, status=diagnostic.status, created=True)
