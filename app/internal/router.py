"""`/internal/v1`: the API that workers use, authenticated with the shared worker token and not
scoped to a project (workers serve every project). Also the public, project-scoped listing of
a job's rollouts, this service's extension of `/v1/fine_tuning/jobs`."""

from __future__ import annotations

import itertools
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse

from app.core.deps import CurrentKey, RowIndex, SessionDep, SettingsDep, require_worker
from app.core.errors import APIError
from app.core.pagination import ListPage
from app.internal import service
from app.internal.schemas import (
    CheckpointPush,
    CheckpointResult,
    ClaimRequest,
    ClaimResponse,
    EventPush,
    EventResult,
    FinishPush,
    FinishResult,
    HeartbeatResponse,
    Leased,
    RolloutObject,
    RolloutPush,
    RolloutResult,
    Split,
    StatePush,
    StateResult,
    StepPush,
    StepResult,
)

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])
public_router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
Step = Annotated[int, Path(ge=0)]


@router.post("/jobs/{job_id}/claim", response_model=ClaimResponse)
def claim_job(job_id: str, body: ClaimRequest, session: SessionDep, settings: SettingsDep) -> ClaimResponse:
    """Take a queued job (or a running one whose worker's lease expired) under a new lease."""
    return service.claim(session=session, settings=settings, job_id=job_id, worker_id=body.worker_id)


@router.post("/jobs/{job_id}/heartbeat", response_model=HeartbeatResponse)
def heartbeat(job_id: str, body: Leased, session: SessionDep, settings: SettingsDep) -> HeartbeatResponse:
    """Extend the lease; the answer says whether to continue, pause (save state) or cancel."""
    answer = service.heartbeat(session=session, settings=settings, job_id=job_id, lease_id=body.lease_id)
    return answer


@router.get("/files/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, request: Request, session: SessionDep) -> StreamingResponse:
    """The bytes of any project's file (training and validation data)."""
    row = service.file_row(session=session, file_id=file_id)
    chunks = request.app.state.storage.iter_chunks(row.storage_key)
    try:  # open the blob before answering, so that missing bytes are a clear error, not a cut stream
        first = next(chunks, b"")
    except FileNotFoundError as exc:
        raise APIError(404, f"The stored bytes of file '{file_id}' are missing.", code="file_content_missing",
                       param="file_id") from exc
    return StreamingResponse(itertools.chain([first], chunks), media_type="application/octet-stream",
                             headers={"Content-Length": str(row.bytes)})


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
def finish_job(job_id: str, body: FinishPush, request: Request, session: SessionDep) -> FinishResult:
    """The end of this worker's run: succeeded (its step metrics become the job's result file),
    failed, or stopped after a pause or cancel."""
    return service.finish(session=session, storage=request.app.state.storage, job_id=job_id, body=body)


@public_router.get("/{fine_tuning_job_id}/rollouts", response_model=ListPage[RolloutObject])
def list_rollouts(
    fine_tuning_job_id: str,
    principal: CurrentKey,
    session: SessionDep,
    step: RowIndex | None = None,
    split: Split | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[RolloutObject]:
    """This service's extension: a job's graded rollouts, newest step first."""
    return service.list_rollouts(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id,
                                 step=step, split=split, after=after, limit=limit)
