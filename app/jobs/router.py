from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from app.core.deps import CurrentKey, RowIndex, SessionDep, SettingsDep, after_response
from app.core.pagination import ListPage
from app.jobs import checkpoints, pipeline, service
from app.jobs.schemas import CheckpointObject, JobCreate, JobEventObject, JobObject, RolloutObject, Split

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
_METADATA_PARAM = re.compile(r"^metadata\[(.+)\]$")

Limit = Annotated[int, Query(ge=1, le=100)]


def _validate_later(background: BackgroundTasks, request: Request, job_id: str) -> None:
    state = request.app.state
    after_response(background, request, pipeline.run_validation, state.session_factory, state.storage, state.queue,
                   job_id, min_rows=state.settings.min_training_rows)


@router.post("", response_model=JobObject)
def create_job(
    body: JobCreate,
    request: Request,
    background: BackgroundTasks,
    principal: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JobObject:
    job, created = service.create_job(
        session=session, settings=settings, project_id=principal.project_id, body=body, idempotency_key=idempotency_key
    )
    if created:
        # Runs after the response, so after SessionDep's commit: the validator sees the job.
        _validate_later(background, request, job.id)
    return job


@router.get("", response_model=ListPage[JobObject])
def list_jobs(
    request: Request, principal: CurrentKey, session: SessionDep, after: str | None = None, limit: Limit = 20
) -> ListPage[JobObject]:
    metadata = {
        m.group(1): value for key, value in request.query_params.multi_items() if (m := _METADATA_PARAM.match(key))
    }
    return service.list_jobs(session=session, project_id=principal.project_id, after=after, limit=limit, metadata=metadata)


@router.get("/{fine_tuning_job_id}", response_model=JobObject)
def retrieve_job(fine_tuning_job_id: str, principal: CurrentKey, session: SessionDep) -> JobObject:
    return service.get_job(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id)


def _action(action: str):  # noqa: ANN202
    def endpoint(
        fine_tuning_job_id: str, request: Request, background: BackgroundTasks, principal: CurrentKey, session: SessionDep
    ) -> JobObject:
        job = service.apply_action(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id, action=action)
        if job.status == "queued":  # resumed (not kept by its worker): sent after SessionDep's commit, as above
            pipeline.send_after_response(background, request, job.id)
        return job

    endpoint.__name__ = f"{action}_job"
    endpoint.__doc__ = {
        "pause": "Pause a queued or running job; its checkpoint and data position are kept.",
        "resume": "Resume a paused job: it is queued and sent to the workers again (or, when its worker has not "
                  "stopped for the pause yet, that worker keeps running it).",
        "cancel": "Cancel a job that has not finished.",
    }[action]
    return endpoint


for _name in ("pause", "resume", "cancel"):
    router.add_api_route(f"/{{fine_tuning_job_id}}/{_name}", _action(_name), methods=["POST"], response_model=JobObject)


@router.get("/{fine_tuning_job_id}/events", response_model=ListPage[JobEventObject])
def list_events(
    fine_tuning_job_id: str, principal: CurrentKey, session: SessionDep, after: str | None = None, limit: Limit = 20
) -> ListPage[JobEventObject]:
    return service.list_events(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id,
                               after=after, limit=limit)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=ListPage[CheckpointObject])
def list_checkpoints(
    fine_tuning_job_id: str, principal: CurrentKey, session: SessionDep, after: str | None = None, limit: Limit = 10
) -> ListPage[CheckpointObject]:
    return service.list_checkpoints(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id,
                                    after=after, limit=limit)


@router.get("/{fine_tuning_job_id}/checkpoints/{checkpoint_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {}},
                             "description": "An uncompressed tar of the checkpoint's files under "
                                            "`<job_id>-step-<N>/`, with a generated README.md."}})
def checkpoint_content(
    fine_tuning_job_id: str, checkpoint_id: str, principal: CurrentKey, session: SessionDep
) -> StreamingResponse:
    """This service's extension: download a checkpoint (a LoRA adapter or a full model directory)."""
    download = checkpoints.open_archive(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id,
                                        checkpoint_id=checkpoint_id)
    return StreamingResponse(
        iter(download.archive), media_type="application/x-tar",
        headers={"Content-Length": str(download.archive.size),
                 "Content-Disposition": f'attachment; filename="{download.filename}"'},
        # Closes the files also when the client went away before the end of the stream.
        background=BackgroundTask(download.archive.close),
    )


@router.get("/{fine_tuning_job_id}/rollouts", response_model=ListPage[RolloutObject])
def list_rollouts(
    fine_tuning_job_id: str,
    principal: CurrentKey,
    session: SessionDep,
    step: RowIndex | None = None,
    split: Split | None = None,
    after: str | None = None,
    limit: Limit = 20,
) -> ListPage[RolloutObject]:
    """This service's extension: a job's graded rollouts, newest step first."""
    return service.list_rollouts(session=session, project_id=principal.project_id, job_id=fine_tuning_job_id,
                                 step=step, split=split, after=after, limit=limit)
