"""The worker side of a job's life (`/internal/v1/jobs/...`): claim under a lease, heartbeat,
and idempotent pushes of what training produces. Every call locks the job's row, so one job's
calls never interleave and a check-then-insert cannot race; every write first checks that the
caller still holds the lease."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from app.auth.models import Project
from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.db import storable_json, unix, utcnow
from app.core.errors import bad_request
from app.core.lifecycle import claim_run, finishing_run, leased_run, locked_run
from app.core.worker_schemas import UNEXPLAINED_FAILURE, HeartbeatResponse
from app.files import service as files
from app.files.storage import Storage
from app.jobs import service as jobs
from app.jobs import step_metrics
from app.jobs.integrations import keys_for_claim
from app.jobs.lineage import base_model_of, checkpoint_named, is_fine_tuned, start_point
from app.jobs.methods import METHODS
from app.jobs.models import Checkpoint, Job, JobEvent, JobMetric, JobRollout, JobStep, WorkerEventKey
from app.jobs.state import JOB_STATES, JobStatus, add_event, transition
from app.jobs.tool_headers import open_headers
from app.jobs.worker_schemas import (
    CheckpointPush,
    CheckpointResult,
    ClaimedJob,
    ClaimResponse,
    EventPush,
    EventResult,
    FinishPush,
    FinishResult,
    RolloutPush,
    RolloutRecord,
    RolloutResult,
    StatePush,
    StartFrom,
    StateResult,
    StepPush,
    StepResult,
)
from app.webhooks import outbox
from app.webhooks.events import CHECKPOINT_CREATED

S = JobStatus
KEPT_BEST_CHECKPOINTS = 3
MAX_METRIC_KEY = 255


# --- claim and heartbeat ------------------------------------------------------------------

def _project_name(session: Session, job: Job) -> str:
    return session.scalar(select(Project.name).where(Project.id == job.project_id)) or ""


def _note_takeover(session: Session, job: Job, previous_owner: str | None, worker_id: str) -> None:
    add_event(session, job, f"Worker {previous_owner or 'unknown'} lost its lease; {worker_id} takes over",
              level="warn", data={"previous_worker": previous_owner, "worker": worker_id})


def claim(*, session: Session, settings: Settings, storage: Storage, job_id: str,
          worker_id: str) -> ClaimResponse | str:
    """The job under a new lease, or, when it ends here without a worker, why (a str): its saved
    state already covers every step (it succeeds), or its base model is no longer its project's to
    train from (it fails)."""
    job = locked_run(session, Job, job_id)
    ended = _end_without_a_worker(session, job, storage, worker_id)
    if ended is not None:
        return ended
    claim_run(job, worker_id, lease_seconds=settings.lease_seconds, now=utcnow(),
              start=lambda: transition(session, job, S.RUNNING, message=f"Job started on worker {worker_id}"),
              took_over=lambda previous: _note_takeover(session, job, previous, worker_id))
    drop_unsaved_steps(session, job)
    return ClaimResponse(lease_id=job.lease_id, lease_expires_at=unix(job.lease_expires_at), job=ClaimedJob(
        id=job.id, project_id=job.project_id, project_name=_project_name(session, job), model=job.model,
        training_file=job.training_file, validation_file=job.validation_file,
        method=open_headers(job.method, secret_box(settings)), seed=job.seed,
        suffix=job.suffix, resume_state=job.resume_state, completed_steps=job.completed_steps,
        resolved_hyperparameters=job.resolved_hyperparameters, start_from=_start_from(session, job),
        integrations=job.integrations or [],
        integration_keys=keys_for_claim(session, job.project_id, job.integrations, secret_box(settings)),
    ))


def _end_without_a_worker(session: Session, job: Job, storage: Storage, worker_id: str) -> str | None:
    """End a claimable job that needs no worker, or that no worker could run, before any work;
    None for every other job (claim_run then decides, lease_held and not_claimable included)."""
    if job.status not in (S.QUEUED.value, S.RUNNING.value) or job.held_elsewhere(worker_id, utcnow()):
        return None
    total = _final_step_saved(session, job)
    if total is not None:
        if job.status == S.QUEUED.value:
            transition(session, job, S.RUNNING, message=f"The saved training state covers all {total} steps and "
                                                        "the final checkpoint is stored: no worker needed")
        _succeed(session, job, storage)
        job.release_lease(remember=False)
        return f"Its saved state covers all {total} steps; it succeeded without a worker."
    if is_fine_tuned(job.model) and start_point(session, job) is None:
        error = _base_model_gone(session, job)
        transition(session, job, S.FAILED, level="error", error=error, message=f"Training failed: {error['message']}")
        job.release_lease(remember=False)
        return error["message"]
    return None


def _final_step_saved(session: Session, job: Job) -> int | None:
    """The job's step count when its saved state covers every step and the last step's checkpoint
    is stored (a run that ended without reporting it: only the finish is missing), else None."""
    data = session.scalar(select(JobStep.data).where(JobStep.job_id == job.id).order_by(JobStep.step.desc()).limit(1))
    total = (data or {}).get("total_steps")
    if not isinstance(total, int) or isinstance(total, bool) or total < 1 or job.completed_steps < total:
        return None
    final = select(Checkpoint.id).where(Checkpoint.job_id == job.id, Checkpoint.step_number == total)
    return total if session.scalar(final) is not None else None


def _base_model_gone(session: Session, job: Job) -> dict[str, Any]:
    """The error of a job whose fine-tuned base its project can no longer train from."""
    found = checkpoint_named(session, job.model)
    if found is not None and found[1].project_id != job.project_id:
        return {"code": "base_model_revoked", "param": "model", "message": (
            f"The base model '{job.model}' is a checkpoint that its owner's project no longer shares with this "
            "project (the checkpoint permission was deleted), so the job cannot load it. Ask the owner to share it "
            "again, then create a new job.")}
    return {"code": "base_model_deleted", "param": "model", "message": (
        f"The base model '{job.model}' was deleted since the job was created, so the job cannot load it.")}


def _start_from(session: Session, job: Job) -> StartFrom | None:
    start = start_point(session, job)
    return StartFrom(**vars(start)) if start is not None else None


def drop_unsaved_steps(session: Session, job: Job) -> None:
    """Forget what an earlier attempt reported past the job's saved training state. A claim resumes
    from `completed_steps`, so the steps after it are sampled and trained again: the records of the
    attempt that died there (rollouts, step metrics, their metrics events, checkpoint rows) would
    otherwise stand beside the new ones and be counted twice. A dropped checkpoint's files are
    written again, at the same path, when the new attempt reaches its step."""
    after = job.completed_steps
    for table in (JobRollout, JobMetric, JobStep):
        session.execute(delete(table).where(table.job_id == job.id, table.step > after))
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step_number > after))
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == "metrics"))
    for event in events:  # a step's metrics event carries its step in the data (one per step)
        if _event_step(event) > after:
            session.delete(event)


def _event_step(event: JobEvent) -> int:
    step = (event.data or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else 0


def heartbeat(*, session: Session, settings: Settings, job_id: str, lease_id: str) -> HeartbeatResponse:
    job = leased_run(session, Job, job_id, lease_id)
    job.extend_lease(settings.lease_seconds)
    action = {S.CANCELLED.value: "cancel", S.PAUSED.value: "pause"}.get(job.status, "continue")
    return HeartbeatResponse(action=action, lease_expires_at=unix(job.lease_expires_at))


# --- pushes -------------------------------------------------------------------------------

def flatten_metrics(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{"scores": {"train_reward_mean": 0.4}} -> {"scores.train_reward_mean": 0.4}; numbers only."""
    flat: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_metrics(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            flat[name] = float(value)
    return flat


def _step_message(data: dict[str, Any]) -> str:
    """A metrics event's message: a supervised step's losses as OpenAI words them ("Step 3/10:
    training loss=0.412, validation loss=0.500"), else a reinforcement step's train reward."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    total = data.get("total_steps")
    message = f"Step {data['step']}/{total}" if total is not None else f"Step {data['step']}"
    losses = [f"{label}={data[key]:.3f}" for key, label in (
        ("train_loss", "training loss"), ("valid_loss", "validation loss"),
        ("full_valid_loss", "full validation loss")) if number(data.get(key))]
    if losses:
        return f"{message}: {', '.join(losses)}"
    reward = (data.get("scores") or {}).get("train_reward_mean")
    if number(reward):
        message += f": train reward {reward:.3f}"
    return message


def push_step(*, session: Session, job_id: str, step: int, body: StepPush) -> StepResult:
    job = leased_run(session, Job, job_id, body.lease_id)
    if body.metrics.step is not None and body.metrics.step != step:
        raise bad_request(f"metrics.step is {body.metrics.step} but the URL names step {step}.", param="metrics.step")
    if session.scalar(select(JobStep.seq).where(JobStep.job_id == job_id, JobStep.step == step)) is not None:
        return StepResult(step=step, created=False)
    data = {**body.metrics.model_dump(mode="json"), "step": step}
    values = {k: v for k, v in flatten_metrics(data).items() if k not in ("step", "total_steps")}
    too_long = next((k for k in values if len(k) > MAX_METRIC_KEY), None)
    if too_long:
        raise bad_request(f"Metric name '{too_long[:80]}…' is longer than {MAX_METRIC_KEY} characters.",
                          param="metrics")
    session.add(JobStep(job_id=job_id, step=step, data=data))
    if values:
        session.execute(insert(JobMetric), [
            {"job_id": job_id, "step": step, "key": key, "value": value} for key, value in values.items()
        ])
    add_event(session, job, _step_message(data), type="metrics", data=data)
    return StepResult(step=step, created=True)


def push_event(*, session: Session, job_id: str, body: EventPush) -> EventResult:
    job = leased_run(session, Job, job_id, body.lease_id)
    known = session.scalar(select(WorkerEventKey.event_id).where(WorkerEventKey.job_id == job_id,
                                                                 WorkerEventKey.key == body.key))
    if known is not None:
        return EventResult(id=known, created=False)
    event = add_event(session, job, body.message, level=body.level, data=body.data)
    session.add(WorkerEventKey(job_id=job_id, key=body.key, event_id=event.id))
    return EventResult(id=event.id, created=True)


def tool_call_count(record: dict[str, Any]) -> int:
    """The calls a rollout record made: its `tool_calls` list (or count); a job's and a
    diagnostic's rollout rows keep it in a column for the dashboard's filters."""
    calls = record.get("tool_calls")
    if isinstance(calls, list):
        return len(calls)
    return calls if isinstance(calls, int) and not isinstance(calls, bool) and calls >= 0 else 0


def push_rollouts(*, session: Session, job_id: str, body: RolloutPush) -> RolloutResult:
    leased_run(session, Job, job_id, body.lease_id)
    records: dict[str, RolloutRecord] = {}
    for record in body.records:
        records.setdefault(record.trace_id, record)  # the first of duplicates within one push wins
    if not records:
        return RolloutResult(stored=0)
    stored = set(session.scalars(select(JobRollout.trace_id).where(JobRollout.job_id == job_id,
                                                                   JobRollout.trace_id.in_(list(records)))))
    new = [r for trace_id, r in records.items() if trace_id not in stored]
    if new:
        session.execute(insert(JobRollout), [
            {"job_id": job_id, "step": body.step, "split": body.split, "trace_id": r.trace_id,
             "sample_index": r.sample_index, "reward": storable_json(r.reward), "finish_reason": r.finish_reason,
             "tool_calls": tool_call_count(r.model_dump()), "data": r.model_dump(mode="json")}
            for r in new
        ])
    return RolloutResult(stored=len(new))


def fine_tuned_model_name(session: Session, job: Job) -> str:
    """OpenAI's `ft:<base model>:<org>:<suffix>:<job id>`; a job started from a fine-tuned model
    names the base model under it, as OpenAI does."""
    base = base_model_of(session, job.project_id, job.model)
    return f"ft:{base}:{_project_name(session, job)}:{job.suffix or ''}:{job.id}"


def _validation_score(checkpoint: Checkpoint, method_type: str) -> float:
    """Higher is better: the score of the job's method (app/jobs/methods/: the validation reward,
    or minus the validation loss); -inf for a checkpoint without it."""
    flat = flatten_metrics(checkpoint.metrics or {})  # a trainer's step metrics nest the scores
    for key, sign in METHODS[method_type].SCORE_KEYS:
        if key in flat:
            return sign * flat[key]
    return -math.inf


def prune_checkpoints(session: Session, job: Job) -> list[str]:
    """Keep the 3 best checkpoints by the method's score (validation reward, or validation loss)
    plus the latest; delete the other rows and return their paths, for the worker to delete the files."""
    rows = list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id)))
    if not rows:
        return []
    method_type = job.method["type"]
    best = sorted(rows, key=lambda c: (_validation_score(c, method_type), c.step_number),
                  reverse=True)[:KEPT_BEST_CHECKPOINTS]
    kept = {c.seq for c in best} | {max(rows, key=lambda c: c.step_number).seq}
    dropped = sorted((c for c in rows if c.seq not in kept), key=lambda c: c.step_number)
    for checkpoint in dropped:
        session.delete(checkpoint)
    return [c.path for c in dropped if c.path]


def push_checkpoint(*, session: Session, job_id: str, step: int, body: CheckpointPush) -> CheckpointResult:
    job = leased_run(session, Job, job_id, body.lease_id)
    existing = session.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job_id, Checkpoint.step_number == step))
    if existing is not None:
        return CheckpointResult(id=existing, created=False, delete_paths=[])
    name = f"{fine_tuned_model_name(session, job)}:ckpt-step-{step}"
    metrics = {"step": step, **body.metrics}
    checkpoint = jobs.record_checkpoint(session=session, job=job, step_number=step, model_ref=name, metrics=metrics)
    checkpoint.path = body.path
    outbox.record_event(session, project_id=job.project_id, event_type=CHECKPOINT_CREATED, data={
        "id": job.id, "checkpoint_id": checkpoint.id, "step_number": step, "fine_tuned_model_checkpoint": name,
        "metrics": metrics})
    delete_paths = prune_checkpoints(session, job)
    session.flush()
    return CheckpointResult(id=checkpoint.id, created=True, delete_paths=delete_paths)


def record_state(*, session: Session, job_id: str, body: StatePush) -> StateResult:
    job = leased_run(session, Job, job_id, body.lease_id)
    job.completed_steps = body.completed_steps
    job.resume_state = body.resume_state
    if body.resolved_hyperparameters is not None:
        job.resolved_hyperparameters = body.resolved_hyperparameters
    if body.trained_tokens is not None:
        job.trained_tokens = body.trained_tokens
    return StateResult(completed_steps=job.completed_steps)


# --- the end of a run ---------------------------------------------------------------------

def _can_move(job: Job, to: JobStatus) -> bool:
    return JOB_STATES.allows(JobStatus(job.status), to)


def _succeed(session: Session, job: Job, storage: Storage) -> None:
    if job.status != S.RUNNING.value:
        # Paused or re-queued meanwhile: the next claim resumes from the saved state and finishes
        # at once; cancelled stays cancelled.
        add_event(session, job, f"Worker {job.lease_owner} finished training while the job was {job.status}; "
                                f"its status stays '{job.status}'.")
        return
    job.fine_tuned_model = fine_tuned_model_name(session, job)
    job.result_files = [_results_file(session, job, storage)]
    transition(session, job, S.SUCCEEDED, message="The job has successfully completed")


def _results_file(session: Session, job: Job, storage: Storage) -> str:
    """The job's step metrics as a `fine-tune-results` file, in the transaction of the status change
    (only reached once per job: a retried finish returns before it)."""
    content = step_metrics.step_metrics_csv(session=session, job_id=job.id).encode()
    created = files.create_generated_file(session=session, storage=storage, project_id=job.project_id,
                                          filename=step_metrics.FILENAME, purpose=files.RESULTS_PURPOSE,
                                          content=content)
    return created.id


def _fail(session: Session, job: Job, body: FinishPush) -> None:
    error = body.error.model_dump() if body.error else UNEXPLAINED_FAILURE
    if not _can_move(job, S.FAILED):
        add_event(session, job, f"Worker failed after the job was {job.status}: {error['message']}", level="error")
        return
    transition(session, job, S.FAILED, level="error", error=error, message=f"Training failed: {error['message']}")


def _stop(session: Session, job: Job, body: FinishPush) -> None:
    target = S(body.status)
    message = (f"Training state saved at step {job.completed_steps}; job paused" if target == S.PAUSED
               else "Worker stopped: job cancelled")
    if job.status == S.RUNNING.value and target == S.PAUSED:
        # A worker pauses only when told to: the job was resumed while it saved its state. It goes
        # back to the queue, and the next claim resumes from that state.
        transition(session, job, S.QUEUED, message=f"Worker {job.lease_owner} stopped for a pause that was "
                                                   f"withdrawn; job re-queued from step {job.completed_steps}")
    elif job.status == S.RUNNING.value:  # the worker stopped on its own; the status follows it
        transition(session, job, target, message=message)
    elif job.status == target.value:  # the user's action already moved the status
        add_event(session, job, message)
    else:
        add_event(session, job, f"Worker stopped ({body.status}) at step {job.completed_steps}; "
                                f"the job's status is '{job.status}'.")


def finish(*, session: Session, storage: Storage, job_id: str, body: FinishPush) -> FinishResult:
    job, retried = finishing_run(session, Job, job_id, body.lease_id)
    if retried:
        return FinishResult(status=job.status, fine_tuned_model=job.fine_tuned_model)
    if body.trained_tokens is not None:
        job.trained_tokens = body.trained_tokens
    if body.status == "succeeded":
        _succeed(session, job, storage)
    elif body.status == "failed":
        _fail(session, job, body)
    else:
        _stop(session, job, body)
    job.release_lease(remember=True)
    return FinishResult(status=job.status, fine_tuned_model=job.fine_tuned_model)
