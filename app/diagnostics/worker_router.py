"""`/internal/v1/diagnostics/...`: a diagnostic's worker API, and the diagnostic a job's worker
runs before training; authenticated with the shared worker token (docs/internal-api.md)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.core.deps import SessionDep, SettingsDep, require_worker
from app.core.worker_schemas import ClaimRequest, HeartbeatResponse, Leased
from app.diagnostics import worker_service as service
from app.diagnostics.schemas import DiagnosticObject
from app.diagnostics.worker_schemas import (
    DiagnosticClaimResponse,
    DiagnosticFinishPush,
    DiagnosticFinishResult,
    DiagnosticRolloutPush,
    DiagnosticRolloutResult,
    JobDiagnostic,
)

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])


@router.post("/diagnostics/{diagnostic_id}/claim", response_model=DiagnosticClaimResponse)
def claim_diagnostic(diagnostic_id: str, body: ClaimRequest, session: SessionDep,
                     settings: SettingsDep) -> DiagnosticClaimResponse:
    """Take a queued diagnostic (or a running one whose worker's lease expired) under a lease;
    `diagnostic.done_samples` lists the samples already stored."""
    return service.claim(session=session, settings=settings, diagnostic_id=diagnostic_id, worker_id=body.worker_id)


@router.post("/diagnostics/{diagnostic_id}/heartbeat", response_model=HeartbeatResponse)
def diagnostic_heartbeat(diagnostic_id: str, body: Leased, session: SessionDep,
                         settings: SettingsDep) -> HeartbeatResponse:
    """Extend the lease; `action` is `cancel` once the user cancelled it (or its job ended)."""
    return service.heartbeat(session=session, settings=settings, diagnostic_id=diagnostic_id, lease_id=body.lease_id)


@router.post("/diagnostics/{diagnostic_id}/rollouts", response_model=DiagnosticRolloutResult)
def push_diagnostic_rollouts(diagnostic_id: str, body: DiagnosticRolloutPush,
                             session: SessionDep) -> DiagnosticRolloutResult:
    """Graded runs and progress; a run already stored is skipped."""
    return service.push_rollouts(session=session, diagnostic_id=diagnostic_id, body=body)


@router.post("/diagnostics/{diagnostic_id}/finish", response_model=DiagnosticFinishResult)
def finish_diagnostic(diagnostic_id: str, body: DiagnosticFinishPush, session: SessionDep) -> DiagnosticFinishResult:
    """The end of the run; the control plane computes the results, summary and verdict."""
    return service.finish(session=session, diagnostic_id=diagnostic_id, body=body)


@router.get("/diagnostics/{diagnostic_id}", response_model=DiagnosticObject)
def get_diagnostic(diagnostic_id: str, session: SessionDep) -> DiagnosticObject:
    """The diagnostic as users see it (a job's worker reads the per-sample signal from it)."""
    return service.worker_view(session=session, diagnostic_id=diagnostic_id)


@router.post("/jobs/{job_id}/diagnostic", response_model=JobDiagnostic)
def job_diagnostic(job_id: str, body: Leased, session: SessionDep) -> JobDiagnostic:
    """The diagnostic a job with `x_open_model.diagnostic` runs before training, created once
    (again after a pause or resume cut it short) and recorded on the job."""
    return service.diagnostic_for_job(session=session, job_id=job_id, lease_id=body.lease_id)
