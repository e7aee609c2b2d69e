"""`/v1/evals`: OpenAI's Evals API (`client.evals`, `client.evals.runs`,
`client.evals.runs.output_items`), and the comparison of runs (`x_compare`, this service's
extension). The workers' routes are worker_router.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, BackgroundTasks, Query, Request

from app.core.deps import CurrentKey, SessionDep, SettingsDep, after_response
from app.core.pagination import ListPage
from app.evals import compare, from_job, pipeline, service
from app.evals.from_job import EvalFromJob, FromJob
from app.evals.schemas import (
    EvalCreate,
    EvalDeleted,
    EvalObject,
    EvalUpdate,
    OutputItemObject,
    RunCreate,
    RunDeleted,
    RunObject,
)

router = APIRouter(prefix="/v1/evals", tags=["evals"])
Limit = Annotated[int, Query(ge=1, le=100)]
Order = Literal["asc", "desc"]


def _send_later(request: Request, background: BackgroundTasks, run_id: str) -> None:
    """To the broker once SessionDep has committed: the worker finds the run."""
    state = request.app.state
    after_response(background, request, pipeline.send_to_workers, state.session_factory, state.queue, run_id)


@router.post("", response_model=EvalObject)
def create_eval(body: EvalCreate, principal: CurrentKey, session: SessionDep, settings: SettingsDep) -> EvalObject:
    """An eval: the schema of its items and its testing criteria (the grader objects jobs take)."""
    return service.create_eval(session=session, settings=settings, project_id=principal.project_id, body=body)


@router.post("/x_from_job/{job_id}", response_model=EvalFromJob)
def eval_from_job(job_id: str, body: FromJob, request: Request, background: BackgroundTasks, principal: CurrentKey,
                  session: SessionDep, settings: SettingsDep) -> EvalFromJob:
    """Extension: an eval from a succeeded job (its grader, its validation file or `file_id`) and a run
    of each model it touched (its start, every kept checkpoint, its final model, and `models`),
    sampling as its rollouts did with its tools; what `agent-rft compare JOB` runs."""
    made = from_job.eval_from_job(session=session, settings=settings, project_id=principal.project_id, job_id=job_id,
                                  body=body)
    for run in made.runs:
        _send_later(request, background, run.id)
    return made


@router.get("", response_model=ListPage[EvalObject])
def list_evals(principal: CurrentKey, session: SessionDep, after: str | None = None, limit: Limit = 20,
               order: Order = "asc", order_by: Literal["created_at", "updated_at"] = "created_at") -> ListPage[EvalObject]:
    return service.list_evals(session=session, project_id=principal.project_id, after=after, limit=limit, order=order)


@router.get("/{eval_id}", response_model=EvalObject)
def retrieve_eval(eval_id: str, principal: CurrentKey, session: SessionDep) -> EvalObject:
    return service.get_eval(session=session, project_id=principal.project_id, eval_id=eval_id)


@router.post("/{eval_id}", response_model=EvalObject)
def update_eval(eval_id: str, body: EvalUpdate, principal: CurrentKey, session: SessionDep) -> EvalObject:
    """Rename it or replace its metadata."""
    return service.update_eval(session=session, project_id=principal.project_id, eval_id=eval_id, body=body)


@router.delete("/{eval_id}", response_model=EvalDeleted)
def delete_eval(eval_id: str, principal: CurrentKey, session: SessionDep) -> EvalDeleted:
    """The eval with its runs and their output items."""
    service.delete_eval(session=session, project_id=principal.project_id, eval_id=eval_id)
    return EvalDeleted(eval_id=eval_id)


@router.get("/{eval_id}/x_compare")
def compare_runs(eval_id: str, request: Request, principal: CurrentKey, session: SessionDep,
                 baseline: str | None = None) -> dict[str, Any]:
    """Extension: two or more runs of the eval side by side (means and spreads of reward, pass rate,
    seconds, tokens and tool calls per item; tool calls per tool; per-item deltas against the
    baseline, the first run unless named, sorted into reward/tool-call quadrants). `run_ids`:
    repeated, comma-separated, or as the `openai` SDK's `extra_query` sends a list (`run_ids[]`)."""
    query = request.query_params
    return compare.compare_runs(session=session, project_id=principal.project_id, eval_id=eval_id,
                                run_ids=query.getlist("run_ids") + query.getlist("run_ids[]"), baseline_run_id=baseline)


@router.post("/{eval_id}/runs", response_model=RunObject)
def create_run(eval_id: str, body: RunCreate, request: Request, background: BackgroundTasks, principal: CurrentKey,
               session: SessionDep, settings: SettingsDep) -> RunObject:
    """A model over the data source's items (a rollout per item against `x_open_model.tools`
    when given), or the given samples (`jsonl`), graded by every testing criterion on a worker."""
    run = service.create_run(session=session, settings=settings, project_id=principal.project_id, eval_id=eval_id,
                             body=body)
    _send_later(request, background, run.id)
    return run


@router.get("/{eval_id}/runs", response_model=ListPage[RunObject])
def list_runs(eval_id: str, principal: CurrentKey, session: SessionDep, after: str | None = None, limit: Limit = 20,
              order: Order = "asc", status: str | None = None) -> ListPage[RunObject]:
    return service.list_runs(session=session, project_id=principal.project_id, eval_id=eval_id, after=after,
                             limit=limit, order=order, status=status)


@router.get("/{eval_id}/runs/{run_id}", response_model=RunObject)
def retrieve_run(eval_id: str, run_id: str, principal: CurrentKey, session: SessionDep) -> RunObject:
    return service.get_run(session=session, project_id=principal.project_id, eval_id=eval_id, run_id=run_id)


@router.post("/{eval_id}/runs/{run_id}/cancel", response_model=RunObject)
def cancel_run(eval_id: str, run_id: str, principal: CurrentKey, session: SessionDep) -> RunObject:
    """Stop a queued or running run; its output items so far stay readable."""
    return service.cancel_run(session=session, project_id=principal.project_id, eval_id=eval_id, run_id=run_id)


@router.delete("/{eval_id}/runs/{run_id}", response_model=RunDeleted)
def delete_run(eval_id: str, run_id: str, principal: CurrentKey, session: SessionDep) -> RunDeleted:
    service.delete_run(session=session, project_id=principal.project_id, eval_id=eval_id, run_id=run_id)
    return RunDeleted(run_id=run_id)


@router.get("/{eval_id}/runs/{run_id}/output_items", response_model=ListPage[OutputItemObject])
def list_output_items(eval_id: str, run_id: str, principal: CurrentKey, session: SessionDep, after: str | None = None,
                      limit: Limit = 20, order: Order = "asc",
                      status: str | None = None) -> ListPage[OutputItemObject]:
    """Each item's sample (input, output, usage, finish reason), its grades and, for a model run,
    its trajectory (`x_trajectory`)."""
    return service.list_output_items(session=session, project_id=principal.project_id, eval_id=eval_id,
                                     run_id=run_id, after=after, limit=limit, order=order, status=status)


@router.get("/{eval_id}/runs/{run_id}/output_items/{output_item_id}", response_model=OutputItemObject)
def retrieve_output_item(eval_id: str, run_id: str, output_item_id: str, principal: CurrentKey,
                         session: SessionDep) -> OutputItemObject:
    return service.get_output_item(session=session, project_id=principal.project_id, eval_id=eval_id, run_id=run_id,
                                   output_item_id=output_item_id)
