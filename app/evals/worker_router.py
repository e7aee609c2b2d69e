"""`/internal/v1/eval_runs/...`: an eval run's worker API, authenticated with the shared worker
token (docs/internal-api.md)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.core.deps import SessionDep, SettingsDep, require_worker
from app.core.worker_schemas import ClaimRequest, HeartbeatResponse, Leased
from app.evals import worker_service as service
from app.evals.worker_schemas import OutputItemsPush, OutputItemsResult, RunClaimResponse, RunFinishPush, RunFinishResult

router = APIRouter(prefix="/internal/v1/eval_runs", tags=["internal"], dependencies=[Depends(require_worker)])


@router.post("/{run_id}/claim", response_model=RunClaimResponse)
def claim_run(run_id: str, body: ClaimRequest, session: SessionDep, settings: SettingsDep) -> RunClaimResponse:
    """Take a queued run (or a running one whose worker's lease expired) under a lease; `run.done`
    lists the output items already stored."""
    return service.claim(session=session, settings=settings, run_id=run_id, worker_id=body.worker_id)


@router.post("/{run_id}/heartbeat", response_model=HeartbeatResponse)
def run_heartbeat(run_id: str, body: Leased, session: SessionDep, settings: SettingsDep) -> HeartbeatResponse:
    """Extend the lease; `action` is `cancel` once the user cancelled the run."""
    return service.heartbeat(session=session, settings=settings, run_id=run_id, lease_id=body.lease_id)


@router.post("/{run_id}/output_items", response_model=OutputItemsResult)
def push_output_items(run_id: str, body: OutputItemsPush, session: SessionDep) -> OutputItemsResult:
    """Graded output items and progress; an item already stored is skipped."""
    return service.push_items(session=session, run_id=run_id, body=body)


@router.post("/{run_id}/finish", response_model=RunFinishResult)
def finish_run(run_id: str, body: RunFinishPush, session: SessionDep) -> RunFinishResult:
    return service.finish(session=session, run_id=run_id, body=body)
