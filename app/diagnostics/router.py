"""`/v1/fine_tuning/alpha/diagnostics` (this service's extension, docs/diagnostics.md) and the
workers' `/internal/v1/diagnostics` routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, BackgroundTasks, Depends, Header, Query, Request
from pydantic import BaseModel, Field

from app.core.deps import INT32_MAX, CurrentKey, RowIndex, SessionDep, SettingsDep, require_worker
from app.core.pagination import ListPage
from app.diagnostics import pipeline, service
from app.diagnostics.schemas import DiagnosticCreate, DiagnosticObject, DiagnosticRolloutObject
from app.internal.schemas import ClaimRequest, FinishError, Leased

router = APIRouter(prefix="/v1/fine_tuning/alpha/diagnostics", tags=["diagnostics"])
internal_router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])


def _validate_later(request: Request, diagnostic_id: str) -> None:
    state = request.app.state
    pipeline.run_validation(state.session_factory, state.storage, state.queue, diagnostic_id)


@router.post("", response_model=DiagnosticObject)
def create_diagnostic(
    body: DiagnosticCreate,
    request: Request,
    background: BackgroundTasks,
    principal: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> DiagnosticObject:
    """Run every sample of a training file `runs_per_sample` times with the job's grader and tools,
    to see which samples can teach the model anything. Same inputs as a job."""
    diagnostic, created = service.create(session=session, settings=settings, project_id=principal.project_id,
                                         body=body, idempotency_key=idempotency_key)
    if created:  # after SessionDep's commit: the validator sees the diagnostic
        background.add_task(_validate_later, request, diagnostic.id)
    return diagnostic


@router.get("", response_model=ListPage[DiagnosticObject])
def list_diagnostics(principal: CurrentKey, session: SessionDep, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListPage[DiagnosticObject]:
    """Diagnostics, newest first (without the per-sample results; retrieve one for those)."""
    return service.list_page(session=session, project_id=principal.project_id, after=after, limit=limit)


@router.get("/{diagnostic_id}", response_model=DiagnosticObject)
def retrieve_diagnostic(diagnostic_id: str, principal: CurrentKey, session: SessionDep) -> DiagnosticObject:
    return service.get(session=session, project_id=principal.project_id, diagnostic_id=diagnostic_id)


@router.post("/{diagnostic_id}/cancel", response_model=DiagnosticObject)
def cancel_diagnostic(diagnostic_id: str, principal: CurrentKey, session: SessionDep) -> DiagnosticObject:
    """Cancel a diagnostic that has not finished; what ran so far stays readable."""
    return service.cancel(session=session, project_id=principal.project_id, diagnostic_id=diagnostic_id)


@router.get("/{diagnostic_id}/rollouts", response_model=ListPage[DiagnosticRolloutObject])
def list_diagnostic_rollouts(
    diagnostic_id: str,
    principal: CurrentKey,
    session: SessionDep,
    sample_index: RowIndex | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[DiagnosticRolloutObject]:
    """The diagnostic's rollouts (the same records as a job's), by sample then run."""
    return service.list_rollouts(session=session, project_id=principal.project_id, diagnostic_id=diagnostic_id,
                                 sample_index=sample_index, after=after, limit=limit)


# --- workers ----------------------------------------------------------------------------------

class DiagnosticRolloutRecord(BaseModel):
    model_config = {"extra": "allow"}

    trace_id: str = Field(min_length=1, max_length=128)
    sample_index: int = Field(ge=0, le=INT32_MAX)
    run_index: int = Field(ge=0, le=INT32_MAX)
    reward: float | None = None
    finish_reason: str | None = Field(None, max_length=64)


class DiagnosticRolloutPush(Leased):
    records: list[DiagnosticRolloutRecord] = Field(default_factory=list, max_length=10000)
    samples_total: int | None = Field(None, ge=0, description="Samples this run covers (after max_samples).")
    load_basis: dict[str, Any] | None = Field(
        None, description="Batch and group sizes per compute_multiplier, as the trainer resolves them, for the "
                          "load projection.")


class DiagnosticFinishPush(Leased):
    status: Literal["succeeded", "failed", "cancelled"]
    error: FinishError | None = None


@internal_router.post("/diagnostics/{diagnostic_id}/claim")
def claim_diagnostic(diagnostic_id: str, body: ClaimRequest, session: SessionDep,
                     settings: SettingsDep) -> dict[str, Any]:
    """Take a queued diagnostic (or a running one whose worker's lease expired) under a lease;
    `diagnostic.done_samples` lists the samples already stored."""
    return service.claim(session=session, settings=settings, diagnostic_id=diagnostic_id, worker_id=body.worker_id)


@internal_router.post("/diagnostics/{diagnostic_id}/heartbeat")
def diagnostic_heartbeat(diagnostic_id: str, body: Leased, session: SessionDep,
                         settings: SettingsDep) -> dict[str, Any]:
    """Extend the lease; `action` is `cancel` once the user cancelled it (or its job ended)."""
    return service.heartbeat(session=session, settings=settings, diagnostic_id=diagnostic_id, lease_id=body.lease_id)


@internal_router.post("/diagnostics/{diagnostic_id}/rollouts")
def push_diagnostic_rollouts(diagnostic_id: str, body: DiagnosticRolloutPush, session: SessionDep) -> dict[str, int]:
    """Graded runs and progress; a run already stored is skipped."""
    return service.push_rollouts(session=session, diagnostic_id=diagnostic_id, lease_id=body.lease_id,
                                 records=[r.model_dump(mode="json") for r in body.records],
                                 samples_total=body.samples_total, load_basis=body.load_basis)


@internal_router.post("/diagnostics/{diagnostic_id}/finish")
def finish_diagnostic(diagnostic_id: str, body: DiagnosticFinishPush, session: SessionDep) -> dict[str, Any]:
    """The end of the run; the control plane computes the results, summary and verdict."""
    return service.finish(session=session, diagnostic_id=diagnostic_id, lease_id=body.lease_id, status=body.status,
                          error=body.error.model_dump() if body.error else None)


@internal_router.get("/diagnostics/{diagnostic_id}", response_model=DiagnosticObject)
def get_diagnostic(diagnostic_id: str, session: SessionDep) -> DiagnosticObject:
    """The diagnostic as users see it (a job's worker reads the per-sample signal from it)."""
    return service.worker_view(session=session, diagnostic_id=diagnostic_id)


@internal_router.post("/jobs/{job_id}/diagnostic")
def job_diagnostic(job_id: str, body: Leased, session: SessionDep) -> dict[str, Any]:
    """The diagnostic a job with `x_open_model.diagnostic` runs before training, created once
    (again after a pause or resume cut it short) and recorded on the job."""
    return service.diagnostic_for_job(session=session, job_id=job_id, lease_id=body.lease_id)
