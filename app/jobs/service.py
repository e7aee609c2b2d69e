"""Fine-tuning jobs: creation with synchronous checks, listing, user actions, events, checkpoints,
and this service's listing of a job's graded rollouts."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.db import unix, utcnow
from app.core.errors import APIError, bad_request, not_found
from agent_rft.ids import new_id
from app.core.pagination import ListPage, page, page_by
from app.files.models import StoredFile
from app.idempotency import service as idempotency
from app.jobs.lineage import fine_tuned_source, is_fine_tuned, training_mode_of
from app.jobs.methods import METHODS
from app.jobs.models import Checkpoint, Job, JobEvent, JobRollout
from app.jobs.schemas import (
    CheckpointObject,
    JobCreate,
    JobError,
    JobEventObject,
    JobHyperparameters,
    JobObject,
    Method,
    RolloutObject,
    SupervisedHyperparameters,
    SupervisedMethod,
    method_block,
)
from app.jobs import tool_headers
from app.jobs.integrations import check_integrations, public_integrations
from app.jobs.state import ACTIONS, ACTIVE, JobStatus, add_event, transition
from app.serving.service import model_not_found

ENDPOINT = "POST /v1/fine_tuning/jobs"


def public_method(method: dict[str, Any]) -> dict[str, Any]:
    """The stored method as the API shows it: tool and grader header values masked (sealed or legacy plain)."""
    return tool_headers.public_headers(method)


def _with_resolved_hyperparameters(method: dict[str, Any], resolved: dict[str, Any] | None) -> dict[str, Any]:
    """Once a worker has resolved the "auto" hyperparameters, report the values it trains with."""
    block = method_block(method)
    if not resolved or not block:
        return method
    stored = block.get("hyperparameters") or {}
    merged = {**stored, **{k: resolved[k] for k in stored if k in resolved}}
    return {**method, method["type"]: {**block, "hyperparameters": merged}}


def to_schema(job: Job) -> JobObject:
    method = _with_resolved_hyperparameters(job.method, job.resolved_hyperparameters)
    hp = method_block(method).get("hyperparameters", {})
    return JobObject(
        id=job.id, created_at=unix(job.created_at), error=JobError(**job.error) if job.error else None,
        fine_tuned_model=job.fine_tuned_model, finished_at=unix(job.finished_at),
        hyperparameters=JobHyperparameters(
            batch_size=hp.get("batch_size", "auto"), learning_rate_multiplier=hp.get("learning_rate_multiplier", "auto"),
            n_epochs=hp.get("n_epochs", "auto"),
        ),
        model=job.model, organization_id=job.project_id, result_files=list(job.result_files or []), seed=job.seed,
        status=job.status, trained_tokens=job.trained_tokens, training_file=job.training_file,
        validation_file=job.validation_file, estimated_finish=unix(job.estimated_finish),
        metadata=job.user_metadata, method=public_method(method), suffix=job.suffix,
        diagnostic_id=job.diagnostic_id, integrations=public_integrations(job.integrations),
    )


def _check_method(body: JobCreate, settings: Settings) -> dict[str, Any]:
    # Without `method`, OpenAI (and its SDK's jobs.create(model, training_file)) makes a supervised job.
    method = _with_top_level_hyperparameters(body.method or Method(type="supervised"), body.hyperparameters)
    return check_method(method, settings)


def _with_top_level_hyperparameters(method: Method, hyperparameters: dict[str, Any] | None) -> Method:
    """OpenAI's deprecated top-level `hyperparameters`, which only a supervised job still takes:
    they become `method.supervised.hyperparameters`, checked as those are."""
    if not hyperparameters:
        return method
    if method.type == "reinforcement":
        raise bad_request("Top-level hyperparameters are deprecated; set method.reinforcement.hyperparameters.",
                          param="hyperparameters")
    if method.type != "supervised":
        return method  # check_method refuses the type itself
    supervised = method.supervised or SupervisedMethod()
    if "hyperparameters" in supervised.model_fields_set:
        raise bad_request("hyperparameters are given twice, at the top level (deprecated) and in "
                          "method.supervised.hyperparameters; give only method.supervised.hyperparameters.",
                          param="hyperparameters")
    try:
        parsed = SupervisedHyperparameters.model_validate(hyperparameters)
    except ValidationError as exc:  # reported as the request's own field errors: param hyperparameters.<field>
        raise RequestValidationError([{**e, "loc": ("body", "hyperparameters", *e["loc"])}
                                      for e in exc.errors()]) from None
    return method.model_copy(update={"supervised": supervised.model_copy(update={"hyperparameters": parsed})})


def check_method(method: Method | None, settings: Settings, *,
                 supported: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The stored form of a `method` block, after every synchronous check (also used by the
    variance diagnostic, which takes the same block but only `supported=("reinforcement",)`)."""
    if method is None:
        raise APIError(400, "method is required: {'type': 'reinforcement', 'reinforcement': {...}}.",
                       code="missing_required_parameter", param="method")
    supported = supported or tuple(METHODS)  # by default every method of the registry
    if method.type not in supported:
        raise APIError(400, f"method.type '{method.type}' is not supported here; use "
                            f"{' or '.join(repr(t) for t in supported)}.", code="unsupported_method", param="method.type")
    given = {name for name, value in method if name != "type" and value is not None}
    for other in sorted(given - {method.type}):  # silently training without the options given would mislead
        raise bad_request(f"method.{other} does not apply to method.type '{method.type}'; give method.{method.type}.",
                          param=f"method.{other}")
    return METHODS[method.type].stored_block(method, settings)


def _check_start(session: Session, project_id: str, model: str, method: dict[str, Any]) -> None:
    """A job may start from one of the project's fine-tuned models or checkpoints (`ft:…`): 404 for
    any other, as for a model that does not exist. A LoRA parent is continued (its adapter trains
    on) or merged into the weights for full training; a full parent can only be trained in full (a
    new adapter on its weights could not be served on the base model)."""
    if not is_fine_tuned(model):
        return
    found = fine_tuned_source(session, project_id, model)
    if found is None:
        raise model_not_found(model)
    options = method_block(method).get("x_open_model") or {}
    if training_mode_of(found[1]) == "full" and options.get("training_mode", "lora") == "lora":
        raise bad_request(f"'{model}' is a full fine-tune: continue it with training_mode 'full' (a LoRA adapter "
                          "on its weights could not be served on the base model).",
                          param=f"method.{method['type']}.x_open_model.training_mode")


def check_file(session: Session, project_id: str, file_id: str, param: str,
               purposes: tuple[str, ...] = ("fine-tune",)) -> None:
    """A file of this project, with one of `purposes`, stored: else 400 naming `param`."""
    row = session.scalar(select(StoredFile).where(StoredFile.id == file_id, StoredFile.project_id == project_id))
    if row is None:
        raise bad_request(f"Invalid file id '{file_id}': no such file.", param=param, code="invalid_file")
    if row.purpose not in purposes:
        raise bad_request(f"File '{file_id}' has purpose '{row.purpose}'; it must be "
                          f"{' or '.join(repr(p) for p in purposes)}.", param=param, code="invalid_file_purpose")
    if row.status != "processed":
        raise bad_request(f"File '{file_id}' is not ready (status '{row.status}').", param=param, code="file_not_ready")


def create_job(
    *, session: Session, settings: Settings, project_id: str, body: JobCreate, idempotency_key: str | None
) -> tuple[JobObject, bool]:
    """Returns the job and whether it is new (False: replayed for a repeated Idempotency-Key)."""
    request_hash = idempotency.hash_json(body.model_dump(mode="json", exclude_unset=True))
    replay = idempotency.claim(session, project_id=project_id, key=idempotency_key, endpoint=ENDPOINT,
                               request_hash=request_hash)
    if replay is not None:
        return get_job(session=session, project_id=project_id, job_id=replay), False
    method = _check_method(body, settings)
    integrations = check_integrations(session, project_id, body.integrations)
    _check_start(session, project_id, body.model, method)
    check_file(session, project_id, body.training_file, "training_file")
    if body.validation_file:
        check_file(session, project_id, body.validation_file, "validation_file")
    job = Job(
        id=new_id("ftjob-"), project_id=project_id, model=body.model, training_file=body.training_file,
        validation_file=body.validation_file, status=JobStatus.VALIDATING_FILES.value, method=method,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31 - 1), suffix=body.suffix,
        user_metadata=body.metadata, result_files=[], integrations=integrations,
    )
    session.add(job)
    session.flush()
    add_event(session, job, f"Created fine-tuning job: {job.id}", data={"status": job.status})
    add_event(session, job, "Validating training file: " + body.training_file)
    idempotency.complete(session, project_id=project_id, key=idempotency_key, object_id=job.id)
    return to_schema(job), True


def get_row(*, session: Session, project_id: str, job_id: str, for_update: bool = False) -> Job:
    stmt = select(Job).where(Job.id == job_id, Job.project_id == project_id)
    if for_update:
        stmt = stmt.with_for_update()
    job = session.scalar(stmt)
    if job is None:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job


def get_job(*, session: Session, project_id: str, job_id: str) -> JobObject:
    return to_schema(get_row(session=session, project_id=project_id, job_id=job_id))


def list_jobs(
    *, session: Session, project_id: str, after: str | None, limit: int, metadata: dict[str, str]
) -> ListPage[JobObject]:
    stmt = select(Job).where(Job.project_id == project_id)
    for key, value in metadata.items():
        stmt = stmt.where(Job.user_metadata[key].as_string() == value)
    rows, has_more = page(session, stmt, Job, after=after, limit=limit)
    return ListPage[JobObject](data=[to_schema(r) for r in rows], has_more=has_more)


def apply_action(*, session: Session, project_id: str, job_id: str, action: str) -> JobObject:
    """Pause, resume or cancel. The answer's status is `queued` when the job must be sent to the workers."""
    job = get_row(session=session, project_id=project_id, job_id=job_id, for_update=True)
    if action == "resume" and job.status == JobStatus.PAUSED.value and job.lease_is_live(utcnow()):
        # Its worker has not stopped for the pause yet (it had not heard of it, or is saving its state):
        # it keeps the job, rather than a second run being queued beside it. A worker that stops anyway
        # re-queues the job when it reports (app/jobs/worker_service.finish).
        transition(session, job, JobStatus.RUNNING,
                   message=f"Job resumed by user; worker {job.lease_owner} had not stopped for the pause and keeps "
                           "running it.")
        return to_schema(job)
    target = ACTIONS[action]
    past = {"pause": "paused", "resume": "resumed", "cancel": "cancelled"}[action]
    transition(session, job, target, action=action, message=f"Job {past} by user.")
    return to_schema(job)


def list_events(*, session: Session, project_id: str, job_id: str, after: str | None, limit: int) -> ListPage[JobEventObject]:
    get_row(session=session, project_id=project_id, job_id=job_id)
    stmt = select(JobEvent).where(JobEvent.job_id == job_id)
    rows, has_more = page(session, stmt, JobEvent, after=after, limit=limit)
    data = [
        JobEventObject(id=e.id, created_at=unix(e.created_at), level=e.level, message=e.message, type=e.type, data=e.data)
        for e in rows
    ]
    return ListPage[JobEventObject](data=data, has_more=has_more)


def list_checkpoints(
    *, session: Session, project_id: str, job_id: str, after: str | None, limit: int
) -> ListPage[CheckpointObject]:
    get_row(session=session, project_id=project_id, job_id=job_id)
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id)
    rows, has_more = page(session, stmt, Checkpoint, after=after, limit=limit)
    data = [
        CheckpointObject(
            id=c.id, created_at=unix(c.created_at), fine_tuned_model_checkpoint=c.fine_tuned_model_checkpoint,
            fine_tuning_job_id=c.job_id, metrics=c.metrics or {}, step_number=c.step_number,
        )
        for c in rows
    ]
    return ListPage[CheckpointObject].of(data, has_more)


def list_rollouts(
    *, session: Session, project_id: str, job_id: str, step: int | None, split: str | None, after: str | None,
    limit: int,
) -> ListPage[RolloutObject]:
    """Newest step first, then newest stored first; `after` is the id (trace_id) of the last
    rollout of the previous page."""
    get_row(session=session, project_id=project_id, job_id=job_id)
    stmt = select(JobRollout).where(JobRollout.job_id == job_id)
    if step is not None:
        stmt = stmt.where(JobRollout.step == step)
    if split is not None:
        stmt = stmt.where(JobRollout.split == split)
    rows, has_more = page_by(session, stmt, order=(JobRollout.step, JobRollout.seq), cursor=JobRollout.trace_id,
                             after=after, limit=limit, noun="rollout")
    data = [RolloutObject(id=r.trace_id, step=r.step, split=r.split, sample_index=r.sample_index, reward=r.reward,
                          finish_reason=r.finish_reason, tool_calls=r.tool_calls, data=r.data) for r in rows]
    return ListPage[RolloutObject].of(data, has_more)


def record_checkpoint(*, session: Session, job: Job, step_number: int, model_ref: str, metrics: dict[str, Any]) -> Checkpoint:
    checkpoint = Checkpoint(id=new_id("ftckpt_"), job_id=job.id, step_number=step_number,
                            fine_tuned_model_checkpoint=model_ref, metrics=metrics)
    session.add(checkpoint)
    add_event(session, job, f"Checkpoint created at step {step_number}", data={"checkpoint": checkpoint.id,
                                                                              "step": step_number})
    session.flush()
    return checkpoint


def active_job_using_file(*, session: Session, project_id: str, file_id: str) -> str | None:
    stmt = select(Job.id).where(
        Job.project_id == project_id,
        Job.status.in_([s.value for s in ACTIVE]),
        (Job.training_file == file_id) | (Job.validation_file == file_id),
    ).limit(1)
    return session.scalar(stmt)


def mark_enqueued(*, session: Session, job_id: str) -> None:
    job = session.scalar(select(Job).where(Job.id == job_id))
    if job is not None and job.status == JobStatus.QUEUED.value:
        job.enqueued_at = utcnow()
