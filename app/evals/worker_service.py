"""The worker side of an eval run (`/internal/v1/eval_runs/...`): claim under a lease like a
job's (app/core/lifecycle.py), heartbeat, pushes of graded output items, finish."""

from __future__ import annotations

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from agent_rft.ids import new_id
from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.db import storable_json, unix, utcnow
from app.core.lifecycle import claim_run, end_run, leased_run, locked_run
from app.core.worker_schemas import HeartbeatResponse
from app.evals import service
from app.evals.models import Eval, EvalOutputItem, EvalRun
from app.evals.state import RUN_STATES, RunStatus, transition
from app.evals.worker_schemas import (
    ClaimedRun,
    OutputItemsPush,
    OutputItemsResult,
    RunClaimResponse,
    RunFinishPush,
    RunFinishResult,
)
from app.jobs.lineage import is_fine_tuned, start_point_of
from app.jobs.tool_headers import open_grader, open_tools
from app.jobs.worker_schemas import StartFrom

S = RunStatus


def _done(session: Session, run_id: str) -> list[tuple[int, int]]:
    return [tuple(pair) for pair in session.execute(select(EvalOutputItem.item_index, EvalOutputItem.sample_index)
                                                    .where(EvalOutputItem.run_id == run_id))]


def claim(*, session: Session, settings: Settings, run_id: str, worker_id: str) -> RunClaimResponse:
    run = locked_run(session, EvalRun, run_id)
    claim_run(run, worker_id, lease_seconds=settings.lease_seconds, now=utcnow(),
              start=lambda: transition(session, run, S.RUNNING))
    evaluation = session.scalar(select(Eval).where(Eval.id == run.eval_id))
    box = secret_box(settings)
    data_source = dict(run.data_source)
    if data_source.get("x_open_model", {}).get("tools"):
        data_source["x_open_model"] = {**data_source["x_open_model"],
                                       "tools": open_tools(data_source["x_open_model"]["tools"], box)}
    start = start_point_of(session, run.project_id, run.model) if is_fine_tuned(run.model) else None
    return RunClaimResponse(
        lease_id=run.lease_id, lease_expires_at=unix(run.lease_expires_at),
        run=ClaimedRun(id=run.id, eval_id=run.eval_id, project_id=run.project_id, model=run.model,
                       start_from=StartFrom(**vars(start)) if start is not None else None, data_source=data_source,
                       testing_criteria=[open_grader(c, box) for c in evaluation.testing_criteria],
                       item_schema=evaluation.data_source_config.get("item_schema") or {},
                       done=_done(session, run.id)))


def heartbeat(*, session: Session, settings: Settings, run_id: str, lease_id: str) -> HeartbeatResponse:
    run = leased_run(session, EvalRun, run_id, lease_id)
    run.extend_lease(settings.lease_seconds)
    action = "cancel" if run.status == S.CANCELLED.value else "continue"
    return HeartbeatResponse(action=action, lease_expires_at=unix(run.lease_expires_at))


def push_items(*, session: Session, run_id: str, body: OutputItemsPush) -> OutputItemsResult:
    """Store new output items ((item, sample) already stored is skipped), and the progress."""
    run = leased_run(session, EvalRun, run_id, body.lease_id)
    if body.items_total is not None:
        run.items_total = body.items_total
    done = set(_done(session, run_id))
    new = []
    for item in body.items:
        key = (item.item_index, item.sample_index)
        if key in done:
            continue
        done.add(key)
        new.append({"id": new_id("outputitem_"), "run_id": run_id, "eval_id": run.eval_id, "created_at": utcnow(),
                    **storable_json(item.model_dump(mode="json"))})
    if new:
        session.execute(insert(EvalOutputItem), new)
    service.refresh_result(session, run)
    return OutputItemsResult(stored=len(new), done=len(done))


def finish(*, session: Session, run_id: str, body: RunFinishPush) -> RunFinishResult:
    status = end_run(session, EvalRun, run_id, body.lease_id, status=body.status,
                     error=body.error.model_dump() if body.error else None, states=RUN_STATES,
                     refresh=lambda row: service.refresh_result(session, row))
    return RunFinishResult(status=status)
