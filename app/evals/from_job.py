"""An eval made from a fine-tuning job, for "which checkpoint should I ship?": the job's grader
(plus any criteria given), its validation file (or another), and one run per model the job
touched: what it started from, every kept checkpoint, its final model (and any other models
named, such as the base under an `ft:` start). Each run samples as the job's rollouts did: the
same tool endpoints (their sealed headers copied, never shown), tool-call budget, token caps,
temperature and precision."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.errors import bad_request, conflict
from app.evals import service
from app.evals.models import EvalRun
from app.evals.schemas import MAX_SAMPLES_PER_ITEM, EvalObject, RunObject
from app.jobs import service as jobs
from app.jobs.models import Checkpoint, Job
from app.jobs.schemas import method_block
from app.jobs.tool_headers import seal_grader

MAX_MODELS = 10


class FromJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file_id: str | None = Field(None, description="The items (JSONL rows as the job's); default its validation file.")
    models: list[str] = Field(default_factory=list, max_length=4,
                              description="Other models to run first, e.g. the base model under an ft: start.")
    testing_criteria: list[dict[str, Any]] = Field(default_factory=list, max_length=8,
                                                   description="Criteria besides the job's grader.")
    samples_per_item: int = Field(1, ge=1, le=MAX_SAMPLES_PER_ITEM)
    name: str | None = Field(None, max_length=256)


class EvalFromJob(BaseModel):
    object: str = "eval.from_job"
    job_id: str
    eval: EvalObject
    runs: list[RunObject]


def job_models(session: Session, job: Job) -> list[tuple[str, str]]:
    """(run name, model) for what the job started from, each kept checkpoint before the last, and
    its final model (the last checkpoint's weights)."""
    checkpoints = list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id)
                                       .order_by(Checkpoint.step_number)))
    models = [("start", job.model)]
    models += [(f"step {c.step_number}", c.fine_tuned_model_checkpoint) for c in checkpoints[:-1]]
    if job.fine_tuned_model:
        models.append((f"final (step {checkpoints[-1].step_number})" if checkpoints else "final", job.fine_tuned_model))
    return models


def _data_source(job: Job, file_id: str, model: str, samples_per_item: int) -> dict[str, Any]:
    """A run's data source sampling as the job's rollouts (its tools' headers stay sealed as stored)."""
    block = method_block(job.method)
    options = block.get("x_open_model") or {}
    params = {"temperature": options.get("temperature", 1.0), "max_completion_tokens": options.get(
        "max_tokens_per_turn", 256), "seed": job.seed}
    if block.get("response_format"):
        params["response_format"] = block["response_format"]
    agent = {"tools": block.get("tools") or [], "max_episode_steps": block.get("max_episode_steps", 10),
             "samples_per_item": samples_per_item, "dtype": options.get("dtype", "auto")}
    if options.get("max_tokens_per_rollout"):
        agent["max_tokens_per_rollout"] = options["max_tokens_per_rollout"]
    return {"type": "completions", "model": model, "source": {"type": "file_id", "id": file_id},
            "input_messages": {"type": "item_reference", "item_reference": "item.messages"},
            "sampling_params": params, "x_open_model": agent}


def eval_from_job(*, session: Session, settings: Settings, project_id: str, job_id: str,
                  body: FromJob) -> EvalFromJob:
    job = jobs.get_row(session=session, project_id=project_id, job_id=job_id)
    if job.status != "succeeded":
        raise conflict(f"Job '{job_id}' has not succeeded (status '{job.status}'): it has no final model to compare.",
                       code="invalid_job_status", param="job_id")
    file_id = body.file_id or job.validation_file
    if file_id is None:
        raise bad_request(f"Job '{job_id}' has no validation file: give file_id.", param="file_id",
                          code="missing_required_parameter")
    jobs.check_file(session, project_id, file_id, "file_id", purposes=service.EVAL_FILE_PURPOSES)
    grader = method_block(job.method).get("grader")
    criteria = [grader] if grader else []  # stored as checked and sealed with the job
    extra = service.checked_criteria(body.testing_criteria, settings, taken=tuple(c["name"] for c in criteria))
    criteria += [seal_grader(c, secret_box(settings)) for c in extra]
    if not criteria:
        raise bad_request(f"Job '{job_id}' has no grader ({job.method.get('type')} job): give testing_criteria.",
                          param="testing_criteria", code="missing_required_parameter")
    models = [(m, m) for m in body.models] + job_models(session, job)
    if len(models) > MAX_MODELS:
        raise bad_request(f"That makes {len(models)} runs; a comparison takes at most {MAX_MODELS}.", param="models")
    evaluation = service.add_eval(session, project_id, name=body.name or f"{job.id} checkpoints",
                                  config={"type": "custom", "item_schema": {"type": "object"},
                                          "include_sample_schema": False},
                                  sealed_criteria=criteria, metadata={"fine_tuning_job_id": job.id})
    runs: list[EvalRun] = [service.add_run(session, evaluation, name=name, model=model,
                                           data_source=_data_source(job, file_id, model, body.samples_per_item))
                           for name, model in models]
    return EvalFromJob(job_id=job.id, eval=service.eval_schema(evaluation), runs=[service.run_schema(r) for r in runs])
