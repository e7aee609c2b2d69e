"""What the dashboard reads, always scoped to the viewer's project. Aggregation happens in SQL
(latest step and reward per job, filtered rollout pages); rows never leave as ORM objects."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import and_, func, or_, select, text, tuple_, type_coerce
from sqlalchemy.dialects.postgresql import JSONB, aggregate_order_by
from sqlalchemy.orm import Session

from app.core.db import unix, utcnow
from agent_rft.tracing import w3c_trace_id
from app.dashboard.charts import charted_keys
from app.jobs import service as jobs
from app.jobs.models import Checkpoint, Job, JobEvent, JobMetric, JobRollout, JobStep
from app.jobs.schemas import method_block
from app.jobs.state import ACTIONS, ACTIVE, TRANSITIONS, JobStatus

JOBS_PER_PAGE = 25
ROLLOUTS_PER_PAGE = 50
EVENTS_SHOWN = 100
TRAIN_REWARD, VALID_REWARD = "scores.train_reward_mean", "scores.valid_reward_mean"
# The rollout engine's finish reasons (workers/engine/rollout.py FINISH_REASONS; the API imports no
# worker code, tests/dashboard checks the two lists agree).
FINISH_REASONS = ("answered", "tool_budget", "token_cap", "truncated", "tool_failure", "parse_error", "deadline")


@dataclass(frozen=True)
class Headline:
    """A number a job's summary shows at its latest step and each checkpoint shows at its own."""
    field: str  # in the job's row, the poll's JSON and a checkpoint's row
    label: str
    key: str  # its metric key (job_metrics)


# A method's headline numbers: what it optimises, on the training batch and on validation.
HEADLINES: dict[str, tuple[Headline, Headline]] = {
    "reinforcement": (Headline("train_reward", "Train reward", TRAIN_REWARD),
                      Headline("valid_reward", "Valid reward", VALID_REWARD)),
    "supervised": (Headline("train_loss", "Train loss", "train_loss"),
                   Headline("valid_loss", "Valid loss", "valid_loss")),
}


def headlines(method: str) -> list[dict[str, str]]:
    return [asdict(h) for h in HEADLINES[method]]


def _aware(ts: datetime | None) -> datetime | None:
    return ts.replace(tzinfo=timezone.utc) if ts is not None and ts.tzinfo is None else ts


def duration_s(job: Job) -> float:
    end = _aware(job.finished_at) or utcnow()
    return max(0.0, (end - _aware(job.created_at)).total_seconds())


def allowed_actions(status: str) -> list[str]:
    """The user actions the job's status allows, in button order."""
    reachable = TRANSITIONS.get(JobStatus(status), frozenset())
    return [action for action, target in ACTIONS.items() if target in reachable]


# --- jobs list ------------------------------------------------------------------------------

def _progress(session: Session, job_ids: list[str]) -> dict[str, tuple[int, int | None]]:
    """Latest reported step and total steps per job."""
    if not job_ids:
        return {}
    latest = (select(JobStep.job_id, func.max(JobStep.step).label("step"))
              .where(JobStep.job_id.in_(job_ids)).group_by(JobStep.job_id).subquery())
    stmt = (select(JobStep.job_id, JobStep.step, JobStep.data["total_steps"].as_integer())
            .join(latest, and_(JobStep.job_id == latest.c.job_id, JobStep.step == latest.c.step)))
    return {job_id: (step, total) for job_id, step, total in session.execute(stmt)}


def _latest_values(session: Session, job_ids: list[str], keys: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """The value at each job's latest step that has the key: {(job_id, key): value}."""
    if not job_ids:
        return {}
    latest = (select(JobMetric.job_id, JobMetric.key, func.max(JobMetric.step).label("step"))
              .where(JobMetric.job_id.in_(job_ids), JobMetric.key.in_(keys))
              .group_by(JobMetric.job_id, JobMetric.key).subquery())
    stmt = select(JobMetric.job_id, JobMetric.key, JobMetric.value).join(latest, and_(
        JobMetric.job_id == latest.c.job_id, JobMetric.key == latest.c.key, JobMetric.step == latest.c.step))
    return {(job_id, key): value for job_id, key, value in session.execute(stmt)}


def _job_row(job: Job, progress: tuple[int, int | None] | None, rewards: dict[tuple[str, str], float]) -> dict[str, Any]:
    step, total = progress or (None, None)
    return {
        "id": job.id, "status": job.status, "model": job.model, "suffix": job.suffix,
        "fine_tuned_model": job.fine_tuned_model, "step": step, "total_steps": total,
        "train_reward": rewards.get((job.id, TRAIN_REWARD)), "valid_reward": rewards.get((job.id, VALID_REWARD)),
        "created_at": unix(job.created_at), "finished_at": unix(job.finished_at), "duration_s": duration_s(job),
        "active": JobStatus(job.status) in ACTIVE,
    }


def numbered_page(session: Session, model: Any, where: list[Any], page: int, per_page: int) -> tuple[int, int, int]:
    """A list page by number: (rows in all, the page clamped to those there are, pages); page p
    shows the rows from (p - 1) * per_page, newest first."""
    total = session.scalar(select(func.count()).select_from(model).where(*where)) or 0
    pages = max(1, math.ceil(total / per_page))
    return total, min(max(page, 1), pages), pages


def list_jobs(*, session: Session, project_id: str, status: str | None, page: int) -> dict[str, Any]:
    where = [Job.project_id == project_id]
    if status:
        where.append(Job.status == status)
    total, page, pages = numbered_page(session, Job, where, page, JOBS_PER_PAGE)
    rows = list(session.scalars(select(Job).where(*where).order_by(Job.seq.desc())
                                .offset((page - 1) * JOBS_PER_PAGE).limit(JOBS_PER_PAGE)))
    ids = [job.id for job in rows]
    progress = _progress(session, ids)
    rewards = _latest_values(session, ids, (TRAIN_REWARD, VALID_REWARD))
    return {"jobs": [_job_row(job, progress.get(job.id), rewards) for job in rows], "total": total,
            "page": page, "pages": pages}


# --- one job --------------------------------------------------------------------------------

def grader_summary(grader: dict[str, Any]) -> dict[str, Any]:
    """Name, type and the fields that say what it checks; sub-graders of a multi grader too."""
    shown = ("operation", "evaluation_metric", "input", "reference", "model", "url", "calculate_output",
             "pass_threshold", "tolerance")
    summary = {"name": grader.get("name"), "type": grader.get("type"),
               "fields": {k: grader[k] for k in shown if grader.get(k) not in (None, "", [])}}
    if isinstance(grader.get("graders"), dict):
        summary["graders"] = [grader_summary({**sub, "name": sub.get("name") or name})
                              for name, sub in grader["graders"].items()]
    return summary


def _page_row(session: Session, job: Job) -> dict[str, Any]:
    """The job's row as the list shows it, plus its method and the latest values of its headlines."""
    method = job.method["type"]
    keys = tuple(dict.fromkeys((TRAIN_REWARD, VALID_REWARD, *(h.key for h in HEADLINES[method]))))
    latest = _latest_values(session, [job.id], keys)
    row = _job_row(job, _progress(session, [job.id]).get(job.id), latest)
    return {**row, "method": method, **{h.field: latest.get((job.id, h.key)) for h in HEADLINES[method]}}


def job_header(*, session: Session, project_id: str, job_id: str) -> dict[str, Any]:
    job = jobs.get_row(session=session, project_id=project_id, job_id=job_id)
    public = jobs.to_schema(job)  # tool headers masked, "auto" hyperparameters resolved once known
    block = method_block(public.method or {})  # method.reinforcement or method.supervised
    return {
        **_page_row(session, job),
        "seed": job.seed, "metadata": job.user_metadata or {}, "error": job.error,
        "training_file": job.training_file, "validation_file": job.validation_file,
        "trained_tokens": job.trained_tokens, "hyperparameters": block.get("hyperparameters") or {},
        "resolved": bool(job.resolved_hyperparameters), "max_episode_steps": block.get("max_episode_steps"),
        "x_open_model": block.get("x_open_model") or {}, "tools": block.get("tools") or [],
        "grader": grader_summary(block.get("grader") or {}), "actions": allowed_actions(job.status),
        "diagnostic_id": getattr(job, "diagnostic_id", None),
    }


def job_status(*, session: Session, project_id: str, job_id: str) -> dict[str, Any]:
    """What a poll needs besides the series: the header's moving parts."""
    job = jobs.get_row(session=session, project_id=project_id, job_id=job_id)
    return {**_page_row(session, job), "actions": allowed_actions(job.status), "error": job.error,
            "trained_tokens": job.trained_tokens}


def _charted(key_column: Any, method: str) -> Any:
    exact, prefixes, excluded = charted_keys(method)
    return and_(or_(key_column.in_(exact), *(key_column.startswith(p, autoescape=True) for p in prefixes)),
                key_column.not_in(excluded))


def chart_series(*, session: Session, job_id: str, method: str,
                 after_step: int) -> dict[str, dict[str, list[float]]]:
    """The series the charts of the job's method draw, `{metric key: {"x": steps, "y": values}}`,
    for the steps after `after_step` (a poll asks only for what is new). PostgreSQL builds the
    JSON itself, one aggregate per key, and psycopg decodes it with json.loads, so a 500-step job
    costs no Python loop over its points."""
    where = (JobMetric.job_id == job_id, JobMetric.step > after_step, _charted(JobMetric.key, method))
    if session.get_bind().dialect.name == "postgresql":
        per_key = (select(JobMetric.key.label("key"),
                          func.array_agg(aggregate_order_by(JobMetric.step, JobMetric.step)).label("x"),
                          func.array_agg(aggregate_order_by(JobMetric.value, JobMetric.step)).label("y"))
                   .where(*where).group_by(JobMetric.key).subquery())
        series = func.json_object_agg(per_key.c.key, func.json_build_object("x", per_key.c.x, "y", per_key.c.y))
        return session.scalar(select(series)) or {}
    series: dict[str, dict[str, list[float]]] = {}
    stmt = select(JobMetric.key, JobMetric.step, JobMetric.value).where(*where).order_by(JobMetric.key, JobMetric.step)
    for key, step, value in session.execute(stmt):
        points = series.setdefault(key, {"x": [], "y": []})
        points["x"].append(step)
        points["y"].append(value)
    return series


def recent_events(*, session: Session, job_id: str, limit: int = EVENTS_SHOWN) -> list[dict[str, Any]]:
    stmt = (select(JobEvent.id, JobEvent.created_at, JobEvent.level, JobEvent.type, JobEvent.message)
            .where(JobEvent.job_id == job_id).order_by(JobEvent.seq.desc()).limit(limit))
    return [{"id": e.id, "created_at": unix(e.created_at), "level": e.level, "type": e.type, "message": e.message}
            for e in session.execute(stmt)]


def checkpoints(*, session: Session, job_id: str) -> list[dict[str, Any]]:
    """Newest first, with every method's headline fields (a checkpoint's metrics are its step's)."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step_number.desc())
    result = []
    for c in session.scalars(stmt):
        metrics = c.metrics or {}
        scores = metrics.get("scores") or {}
        result.append({
            "id": c.id, "step": c.step_number, "model": c.fine_tuned_model_checkpoint, "created_at": unix(c.created_at),
            "train_reward": scores.get("train_reward_mean"), "valid_reward": scores.get("valid_reward_mean"),
            "train_loss": metrics.get("train_loss"), "valid_loss": metrics.get("valid_loss"),
        })
    return result


# --- rollouts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RolloutFilter:
    step: int | None = None
    split: str | None = None
    sample: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    finish_reason: str | None = None
    tool: str | None = None

    def query(self) -> dict[str, Any]:
        """As query parameters, for links that keep the filter."""
        return {k: v for k, v in self.__dict__.items() if v is not None and v != ""}


def _uses_tool(session: Session, tool: str) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        # jsonb containment: some element of tool_calls has this name
        return type_coerce(JobRollout.data, JSONB)["tool_calls"].contains([{"name": tool}])
    return text("EXISTS (SELECT 1 FROM json_each(job_rollouts.data, '$.tool_calls') AS c "
                "WHERE json_extract(c.value, '$.name') = :tool)").bindparams(tool=tool)


def _rollout_conditions(session: Session, job_id: str, f: RolloutFilter) -> list[Any]:
    where: list[Any] = [JobRollout.job_id == job_id]
    if f.step is not None:
        where.append(JobRollout.step == f.step)
    if f.split:
        where.append(JobRollout.split == f.split)
    if f.sample is not None:
        where.append(JobRollout.sample_index == f.sample)
    if f.reward_min is not None:
        where.append(JobRollout.reward >= f.reward_min)
    if f.reward_max is not None:
        where.append(JobRollout.reward <= f.reward_max)
    if f.finish_reason:
        where.append(JobRollout.finish_reason == f.finish_reason)
    if f.tool:
        where.append(_uses_tool(session, f.tool))
    return where


def _tool_counts(calls: Any) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for call in calls if isinstance(calls, list) else []:
        if isinstance(call, dict):
            name = str(call.get("name"))
            counts[name] = counts.get(name, 0) + 1
    return sorted(counts.items())


def _rollout_anchor(session: Session, job_id: str, trace_id: str) -> Any:
    """Where the rollout a page continues after sits in the listing's order; None if unknown."""
    return session.execute(select(JobRollout.step, JobRollout.sample_index, JobRollout.seq).where(
        JobRollout.job_id == job_id, JobRollout.trace_id == trace_id)).first()


def list_rollouts(*, session: Session, job_id: str, f: RolloutFilter, after: str | None,
                  limit: int = ROLLOUTS_PER_PAGE) -> dict[str, Any]:
    """Newest step first, then by sample; `after` is the trace id of the previous page's last row.
    An `after` that names no rollout of the job lists the first page, and `cursor_error` says so:
    the page shows it beside the filters' errors instead of failing."""
    order = (JobRollout.step.desc(), JobRollout.sample_index, JobRollout.seq)
    where = _rollout_conditions(session, job_id, f)
    anchor = _rollout_anchor(session, job_id, after) if after else None
    cursor_error = f"No rollout with id '{after}' to page after." if after and anchor is None else None
    if anchor is not None:
        # `step <= anchor` first, so the (job_id, step) index bounds the scan; then the exact order.
        where += [JobRollout.step <= anchor.step, or_(JobRollout.step < anchor.step, tuple_(
            JobRollout.sample_index, JobRollout.seq) > tuple_(anchor.sample_index, anchor.seq))]
    d = JobRollout.data
    stmt = (select(JobRollout.trace_id, JobRollout.step, JobRollout.split, JobRollout.sample_index,
                   JobRollout.reward, JobRollout.finish_reason, JobRollout.tool_calls, d["tool_calls"],
                   d["completion_tokens"], d["wall_time_s"], d["excluded"], d["advantage"])
            .where(*where).order_by(*order).limit(limit + 1))
    rows = session.execute(stmt).all()
    data = [{
        "trace_id": r[0], "step": r[1], "split": r[2], "sample_index": r[3], "reward": r[4], "finish_reason": r[5],
        "tool_calls": r[6], "tools": _tool_counts(r[7]), "completion_tokens": r[8], "wall_time_s": r[9],
        "excluded": r[10], "advantage": r[11],
    } for r in rows[:limit]]
    return {"rollouts": data, "has_more": len(rows) > limit, "cursor_error": cursor_error,
            "next_after": data[-1]["trace_id"] if len(rows) > limit else None}


def _pretty_arguments(arguments: Any) -> str:
    if not isinstance(arguments, str):
        return json.dumps(arguments, indent=2, ensure_ascii=False)
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def transcript(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollout as the model lived it: prompt messages, then each assistant turn followed by
    the tool calls it made (with their outputs matched by call id) and any feedback."""
    calls = {c.get("call_id"): c for c in record.get("tool_calls") or [] if isinstance(c, dict)}
    shown: set[str] = set()
    entries: list[dict[str, Any]] = []
    turn = 0
    for message in record.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role = message.get("role", "?")
        if role == "tool":
            call_id = message.get("tool_call_id")
            call = calls.get(call_id) or {"name": message.get("name"), "call_id": call_id}
            shown.add(call_id)
            entries.append(_tool_entry(call, _content_text(message.get("content"))))
            continue
        if role == "assistant":
            turn += 1
        entries.append({"kind": "message", "role": role, "turn": turn if role == "assistant" else None,
                        "content": _content_text(message.get("content"))})
    # Calls whose output never reached the model (the rollout ended on a failed call).
    entries += [_tool_entry(c, None) for cid, c in calls.items() if cid not in shown]
    return entries


def _tool_entry(call: dict[str, Any], output: str | None) -> dict[str, Any]:
    latency = call.get("latency_s")
    return {"kind": "tool", "name": call.get("name"), "call_id": call.get("call_id"),
            "arguments": _pretty_arguments(call.get("arguments", "")), "status": call.get("status"),
            "status_code": call.get("status_code"), "latency_ms": latency * 1000 if isinstance(latency, (int, float)) else None,
            "bytes": call.get("bytes"), "truncated": bool(call.get("truncated")), "error": call.get("error"),
            "cached": bool(call.get("cached")), "output": output}


def rollout_detail(*, session: Session, job_id: str, trace_id: str) -> dict[str, Any] | None:
    row = session.scalar(select(JobRollout).where(JobRollout.job_id == job_id, JobRollout.trace_id == trace_id))
    if row is None:
        return None
    record = row.data or {}
    return {
        "trace_id": row.trace_id, "step": row.step, "split": row.split, "sample_index": row.sample_index,
        "reward": row.reward, "finish_reason": row.finish_reason, "tool_calls": row.tool_calls,
        "advantage": record.get("advantage"), "excluded": record.get("excluded"),
        "grader_errors": record.get("grader_errors") or [], "grader_details": record.get("grader_details"),
        "sub_rewards": record.get("sub_rewards") or {}, "final_answer": record.get("final_answer"),
        "usage": {k: record.get(k) for k in ("prompt_tokens", "completion_tokens", "tool_output_tokens")},
        "turns": record.get("turns"), "parse_errors": record.get("parse_errors"),
        "policy_versions": record.get("policy_versions") or [],
        "wall_time_s": record.get("wall_time_s"), "entries": transcript(record),
        "w3c_trace_id": w3c_trace_id(row.trace_id),
    }
