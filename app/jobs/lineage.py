"""Which weights a fine-tuned model name stands for, and what a job starts from.

`ft:…` names are a job's model (its latest checkpoint) or one checkpoint (`…:ckpt-step-N`), within
one project, plus the checkpoints other projects share with it (checkpoint permissions: only
checkpoint names are shared, never a job's model name). A job may start from such a name: its
weights then come from that checkpoint, and its base model is the first non-`ft:` model up the
chain (what serving loads a LoRA adapter on, and what the new model's name starts with).

Every lookup reads the permissions afresh: a revoked share stops resolving on the next request."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from app.jobs.models import Checkpoint, CheckpointPermission, Job
from app.jobs.schemas import method_block

FINE_TUNED_PREFIX = "ft:"
MAX_CHAIN = 64  # jobs started from jobs started from …: far more than any real chain


@dataclass
class StartPoint:
    """A fine-tuned model a job starts from: its checkpoint and how it was trained."""

    checkpoint_path: str
    training_mode: str  # "lora": an adapter on `base_model`; "full": a whole model directory
    base_model: str


def is_fine_tuned(name: str) -> bool:
    return name.startswith(FINE_TUNED_PREFIX)


def fine_tuned_source(session: Session, project_id: str, name: str) -> tuple[Checkpoint, Job] | None:
    """The checkpoint an `ft:` name stands for in this project (a checkpoint's own name, a job's
    latest checkpoint, or a checkpoint another project shares with it) and its job (of the owner
    project); None when the project has no such model."""
    found = checkpoint_by_name(session, project_id, name)
    if found is not None:
        return found
    job = job_by_model(session, project_id, name)
    checkpoint = latest_checkpoint(session, job.id) if job is not None else None
    if checkpoint is not None:
        return checkpoint, job
    return shared_checkpoint(session, project_id, name)


def checkpoint_by_name(session: Session, project_id: str, name: str) -> tuple[Checkpoint, Job] | None:
    row = session.execute(
        select(Checkpoint, Job).join(Job, Job.id == Checkpoint.job_id)
        .where(Job.project_id == project_id, Checkpoint.fine_tuned_model_checkpoint == name)
    ).first()
    return (row[0], row[1]) if row else None


def shared_checkpoint(session: Session, project_id: str, name: str) -> tuple[Checkpoint, Job] | None:
    """A checkpoint of another project that a permission shares with this one, and its job. The
    permission counts only for the project that owns the checkpoint (the one that granted it)."""
    granted = and_(CheckpointPermission.fine_tuned_model_checkpoint == Checkpoint.fine_tuned_model_checkpoint,
                   CheckpointPermission.owner_project_id == Job.project_id)
    row = session.execute(
        select(Checkpoint, Job).join(Job, Job.id == Checkpoint.job_id).join(CheckpointPermission, granted)
        .where(CheckpointPermission.project_id == project_id, Checkpoint.fine_tuned_model_checkpoint == name)
    ).first()
    return (row[0], row[1]) if row else None


def job_by_model(session: Session, project_id: str, name: str) -> Job | None:
    """The project's job whose fine-tuned model is `name` (not deleted)."""
    return session.scalar(select(Job).where(Job.project_id == project_id, Job.fine_tuned_model == name,
                                            Job.model_deleted_at.is_(None)))


def latest_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id)
                          .order_by(Checkpoint.step_number.desc()).limit(1))


def base_model_of(session: Session, project_id: str, model: str) -> str:
    """The base model under `model`, a name as `project_id` sees it: itself, or the base of the
    fine-tuned model it names. Each step up reads the parent job's model in the parent job's
    project: a shared checkpoint's job was created in its owner's project, from that project's
    models, which the project looking at it need not see."""
    for _ in range(MAX_CHAIN):
        found = _parent(session, project_id, model) if is_fine_tuned(model) else None
        if found is None:
            return model
        project_id, model = found[1].project_id, found[1].model
    return model


def _parent(session: Session, project_id: str, name: str) -> tuple[Checkpoint, Job] | None:
    """What a job's `model` names, for finding its base model only (never for access): as
    `fine_tuned_source`, or a checkpoint whose share was revoked since. The job passed the access
    check when it was created, and what the model trained from it is served on must not change
    when the owner stops sharing (checkpoint names carry their job's id: one project has each)."""
    return fine_tuned_source(session, project_id, name) or checkpoint_named(session, name)


def checkpoint_named(session: Session, name: str) -> tuple[Checkpoint, Job] | None:
    """The checkpoint called `name` in any project, and its job: lineage only, never access."""
    row = session.execute(select(Checkpoint, Job).join(Job, Job.id == Checkpoint.job_id)
                          .where(Checkpoint.fine_tuned_model_checkpoint == name)).first()
    return (row[0], row[1]) if row else None


def base_model_under(session: Session, job: Job) -> str:
    """The base model under what `job` trained from (its own project's view of its model)."""
    return base_model_of(session, job.project_id, job.model)


def start_point(session: Session, job: Job) -> StartPoint | None:
    """What `job` starts from when its model is a fine-tuned one; None for a base model (or a
    fine-tuned model deleted, or a checkpoint share revoked, since the job was created: the worker
    then fails to load it by name)."""
    return start_point_of(session, job.project_id, job.model)


def start_point_of(session: Session, project_id: str, model: str) -> StartPoint | None:
    """The weights `model` stands for in `project_id` when it is a fine-tuned name (a job's start,
    an eval run's model); None for a base model or one the project can no longer see."""
    found = fine_tuned_source(session, project_id, model) if is_fine_tuned(model) else None
    if found is None:
        return None
    checkpoint, parent = found
    return StartPoint(checkpoint_path=checkpoint.path, training_mode=training_mode_of(parent),
                      base_model=base_model_under(session, parent))


def training_mode_of(job: Job) -> str:
    return (method_block(job.method).get("x_open_model") or {}).get("training_mode", "lora")
