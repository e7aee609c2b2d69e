"""Variance diagnostics: creation (with the job's own checks), reading, cancel, the rollouts
listing, and the worker side (claim, heartbeat, pushes, finish) under a lease like a job's."""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import func, insert, select, tuple_
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.db import storable_json, unix, utcnow
from app.core.errors import bad_request, conflict, not_found
from app.core.ids import new_id
from app.core.lifecycle import claim_run, finishing_run, leased_run, locked_run
from app.core.pagination import ListPage, page
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
from app.jobs.models import Job
from app.jobs.schemas import JobError, OpenModelOptions
from app.jobs.state import ACTIVE as JOB_ACTIVE
from app.jobs.state import add_event

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
        max_samples=diagnostic.max_samples, seed=diagnostic.seed, metadata=diagnostic.user_metadata,
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
    method = jobs.check_method(body.method, settings)
    jobs.check_file(session, project_id, body.training_file, "training_file")
    diagnostic = Diagnostic(
        id=new_id("diag-"), project_id=project_id, model=body.model, training_file=body.training_file,
        method=method, runs_per_sample=body.runs_per_sample, max_samples=body.max_samples,
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
    data = [to_schema(r, with_samples=False) for r in rows]
    return ListPage[DiagnosticObject](data=data, has_more=has_more, first_id=data[0].id if data else None,
                                      last_id=data[-1].id if data else None)


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
    if after:
        anchor = session.execute(select(DiagnosticRollout.sample_index, DiagnosticRollout.run_index).where(
            DiagnosticRollout.diagnostic_id == diagnostic_id, DiagnosticRollout.trace_id == after)).first()
        if anchor is None:
            raise bad_request(f"No rollout with id '{after}' to page after.", param="after")
        stmt = stmt.where(tuple_(DiagnosticRollout.sample_index, DiagnosticRollout.run_index)
                          > tuple_(anchor.sample_index, anchor.run_index))
    order = (DiagnosticRollout.sample_index.asc(), DiagnosticRollout.run_index.asc())
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    data = [DiagnosticRolloutObject(id=r.trace_id, sample_index=r.sample_index, run_index=r.run_index,
                                    reward=r.reward, finish_reason=r.finish_reason, tool_calls=r.tool_calls,
                                    data=r.data) for r in rows[:limit]]
    return ListPage[DiagnosticRolloutObject](data=data, has_more=len(rows) > limit,
                                             first_id=data[0].id if data else None,
                                             last_id=data[-1].id if data else None)


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


# --- the worker side ------------------------------------------------------------------------

def done_samples(session: Session, diagnostic: Diagnostic) -> list[int]:
    """Samples with every run stored: a worker that takes over skips them."""
    stmt = (select(DiagnosticRollout.sample_index).where(DiagnosticRollout.diagnostic_id == diagnostic.id)
            .group_by(DiagnosticRollout.sample_index)
            .having(func.count() >= diagnostic.runs_per_sample).order_by(DiagnosticRollout.sample_index))
    return list(session.scalars(stmt))


def claim(*, session: Session, settings: Settings, diagnostic_id: str, worker_id: str) -> dict[str, Any]:
    diagnostic = locked_run(session, Diagnostic, diagnostic_id)
    claim_run(diagnostic, worker_id, lease_seconds=settings.lease_seconds, now=utcnow(),
              start=lambda: transition(session, diagnostic, S.RUNNING))
    return {"lease_id": diagnostic.lease_id, "lease_expires_at": unix(diagnostic.lease_expires_at), "diagnostic": {
        "id": diagnostic.id, "project_id": diagnostic.project_id, "job_id": diagnostic.job_id,
        "model": diagnostic.model, "training_file": diagnostic.training_file, "method": diagnostic.method,
        "runs_per_sample": diagnostic.runs_per_sample, "max_samples": diagnostic.max_samples,
        "seed": diagnostic.seed, "done_samples": done_samples(session, diagnostic)}}


def _job_is_over(session: Session, diagnostic: Diagnostic) -> bool:
    if diagnostic.job_id is None:
        return False
    status = session.scalar(select(Job.status).where(Job.id == diagnostic.job_id))
    return status not in {s.value for s in JOB_ACTIVE}


def heartbeat(*, session: Session, settings: Settings, diagnostic_id: str, lease_id: str) -> dict[str, Any]:
    diagnostic = leased_run(session, Diagnostic, diagnostic_id, lease_id)
    diagnostic.extend_lease(settings.lease_seconds)
    stop = diagnostic.status == S.CANCELLED.value or _job_is_over(session, diagnostic)
    return {"action": "cancel" if stop else "continue", "lease_expires_at": unix(diagnostic.lease_expires_at)}


def _tool_call_count(record: dict[str, Any]) -> int:
    calls = record.get("tool_calls")
    return len(calls) if isinstance(calls, list) else 0


def push_rollouts(*, session: Session, diagnostic_id: str, lease_id: str, records: list[dict[str, Any]],
                  samples_total: int | None, load_basis: dict[str, Any] | None) -> dict[str, int]:
    """Store new runs (a (sample, run) or trace id already stored is skipped) and the progress."""
    diagnostic = leased_run(session, Diagnostic, diagnostic_id, lease_id)
    if samples_total is not None:
        diagnostic.samples_total = samples_total
    if load_basis is not None:
        diagnostic.load_basis = load_basis
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
                    "tool_calls": _tool_call_count(record), "data": record})
    if new:
        session.execute(insert(DiagnosticRollout), new)
    diagnostic.rollouts_done = len(runs)
    diagnostic.samples_done = len(done_samples(session, diagnostic))
    return {"stored": len(new), "samples_done": diagnostic.samples_done, "rollouts_done": diagnostic.rollouts_done}


def finish(*, session: Session, diagnostic_id: str, lease_id: str, status: str,
           error: dict[str, Any] | None) -> dict[str, Any]:
    diagnostic, retried = finishing_run(session, Diagnostic, diagnostic_id, lease_id)
    if retried:
        return {"status": diagnostic.status}
    if diagnostic.status == S.RUNNING.value:
        target = S(status)
        if target == S.FAILED:
            error = error or {"code": "worker_error", "message": "The worker reported a failure without details.",
                              "param": None}
        transition(session, diagnostic, target, error=error if target == S.FAILED else None)
    refresh_result(session, diagnostic)
    diagnostic.release_lease(remember=True)
    return {"status": diagnostic.status}


def worker_view(*, session: Session, diagnostic_id: str) -> DiagnosticObject:
    diagnostic = session.scalar(select(Diagnostic).where(Diagnostic.id == diagnostic_id))
    if diagnostic is None:
        raise not_found("diagnostic", diagnostic_id, param="diagnostic_id")
    return to_schema(diagnostic)


# --- a job's diagnostic -----------------------------------------------------------------------

def job_options(job: Job) -> Any:
    options = OpenModelOptions.model_validate((job.method.get("reinforcement") or {}).get("x_open_model") or {})
    return options.diagnostic


def diagnostic_for_job(*, session: Session, job_id: str, lease_id: str) -> dict[str, Any]:
    """The diagnostic a job runs before training: the one it recorded unless that one was
    cancelled or failed (a paused and resumed job), else a new one, recorded on the job."""
    job = leased_run(session, Job, job_id, lease_id)
    options = job_options(job)
    if options is None:
        raise bad_request(f"Job '{job_id}' has no x_open_model.diagnostic option.", param="job_id")
    if job.diagnostic_id:
        current = session.scalar(select(Diagnostic).where(Diagnostic.id == job.diagnostic_id))
        if current is not None and current.status not in (S.CANCELLED.value, S.FAILED.value):
            return {"id": current.id, "status": current.status, "created": False}
    diagnostic = Diagnostic(
        id=new_id("diag-"), project_id=job.project_id, job_id=job.id, model=job.model,
        training_file=job.training_file, method=job.method, runs_per_sample=options.runs_per_sample,
        max_samples=options.max_samples, seed=job.seed, status=S.QUEUED.value,
    )
    session.add(diagnostic)
    session.flush()
    job.diagnostic_id = diagnostic.id
    add_event(session, job, f"Variance diagnostic {diagnostic.id} created: every sample runs "
                            f"{options.runs_per_sample} times before training.", data={"diagnostic_id": diagnostic.id})
    return {"id": diagnostic.id, "status": diagnostic.status, "created": True}
