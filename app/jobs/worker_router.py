"""`/internal/v1/jobs/...`: a job's worker API, authenticated with the shared worker token and
not scoped to a project (workers serve every project); docs/internal-api.md."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Depends, Path, Request
from fastapi.responses import JSONResponse

from app.core.deps import SessionDep, SettingsDep, require_worker
from app.core.errors import error_body
from app.core.worker_schemas import ClaimRequest, HeartbeatResponse, Leased
from app.jobs import pipeline
from app.jobs import worker_service as service
from app.jobs.worker_schemas import (
    CheckpointPush,
    CheckpointResult,
    ClaimResponse,
    EventPush,
    EventResult,
    FinishPush,
    FinishResult,
    RolloutPush,
    RolloutResult,
    StatePush,
    StateResult,
    StepPush,
    StepResult,
)

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])
Step = Annotated[int, Path(ge=0)]


@router.post("/jobs/{job_id}/claim", response_model=ClaimResponse,
             responses={409: {"description": "lease_held (try later) or not_claimable (nothing to run)"}})
def claim_job(job_id: str, body: ClaimRequest, request: Request, session: SessionDep,
              settings: SettingsDep) -> ClaimResponse | JSONResponse:
    """Take a queued job (or a running one whose worker's lease expired) under a new lease. A job
    that ends here (its saved state covers every step, or its base model is gone) is answered
    409 not_claimable, and its end is committed."""
    claimed = service.claim(session=session, settings=settings, storage=request.app.state.storage, job_id=job_id,
                            worker_id=body.worker_id)
    if isinstance(claimed, str):  # an answer, not a raised error: the job's end must be committed
        return JSONResponse(error_body(f"Job '{job_id}' ended at the claim: {claimed}", type="invalid_request_error",
                                       code="not_claimable", param=None), status_code=409)
    return claimed


@router.post("/jobs/{job_id}/heartbeat", response_model=HeartbeatResponse)
def heartbeat(job_id: str, body: Leased, session: SessionDep, settings: SettingsDep) -> HeartbeatResponse:
    """Extend the lease; the answer says whether to continue, pause (save state) or cancel."""
    answer = service.heartbeat(session=session, settings=settings, job_id=job_id, lease_id=body.lease_id)
    return answer


@router.put("/jobs/{job_id}/steps/{step}", response_model=StepResult)
def push_step(job_id: str, step: Step, body: StepPush, session: SessionDep) -> StepResult:
    """A training step's metrics; the first push of a step stores them, a repeat changes nothing."""
    return service.push_step(session=session, job_id=job_id, step=step, body=body)


@router.post("/jobs/{job_id}/events", response_model=EventResult)
def push_event(job_id: str, body: EventPush, session: SessionDep) -> EventResult:
    """A job event, written once per idempotency key."""
    return service.push_event(session=session, job_id=job_id, body=body)


@router.post("/jobs/{job_id}/rollouts", response_model=RolloutResult)
def push_rollouts(job_id: str, body: RolloutPush, session: SessionDep) -> RolloutResult:
    """Rollout records of a step; a trace_id already stored is ignored."""
    return service.push_rollouts(session=session, job_id=job_id, body=body)


@router.put("/jobs/{job_id}/checkpoints/{step}", response_model=CheckpointResult)
def push_checkpoint(job_id: str, step: Step, body: CheckpointPush, session: SessionDep) -> CheckpointResult:
    """A checkpoint saved at `step`; the answer lists pruned checkpoints whose files to delete."""
    return service.push_checkpoint(session=session, job_id=job_id, step=step, body=body)


@router.post("/jobs/{job_id}/state", response_model=StateResult)
def record_state(job_id: str, body: StatePush, session: SessionDep) -> StateResult:
    """The point a new worker resumes from: saved training state and steps done."""
    return service.record_state(session=session, job_id=job_id, body=body)


@router.post("/jobs/{job_id}/finish", response_model=FinishResult)
def finish_job(job_id: str, body: FinishPush, request: Request, background: BackgroundTasks,
               session: SessionDep) -> FinishResult:
    """The end of this worker's run: succeeded (its step metrics become the job's result file),
    failed, or stopped after a pause or cancel. A job resumed while its worker was stopping for the
    pause is queued again, and sent to the workers after the commit."""
    result = service.finish(session=session, storage=request.app.state.storage, job_id=job_id, body=body)
    if result.status == "queued":
        pipeline.send_after_response(background, request, job_id)
    return result
