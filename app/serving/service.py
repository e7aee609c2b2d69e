"""Model names: which model a chat request means, within the caller's project; `/v1/models`.

A name is one of
- a base model this deployment serves (`Settings.inference_models`), owned by "agent-rft";
- a job's `fine_tuned_model` (`ft:<base>:<project>:<suffix>:<job id>`): its latest checkpoint;
- a checkpoint's `fine_tuned_model_checkpoint` (`...:ckpt-step-N`), the project's own or one another
  project shares with it (a checkpoint permission; owned by that project).
Another project's model answers 404 `model_not_found`, exactly like one that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.db import unix, utcnow
from app.core.errors import APIError
from app.jobs.lineage import (
    base_model_under,
    checkpoint_by_name,
    fine_tuned_source,
    job_by_model,
    shared_checkpoint,
)
from app.jobs.models import Checkpoint, Job
from app.serving.schemas import ModelDeleted, ModelList, ModelObject

SYSTEM_OWNER = "agent-rft"
DEPLOYMENT_CREATED = 1764547200  # 2025-12-01: base models have no creation time of their own


@dataclass(frozen=True)
class ResolvedModel:
    """What the inference server needs to serve a name: the base model, and a checkpoint
    directory (a LoRA adapter or a full model) unless the name is a base model itself."""

    name: str
    base: str
    checkpoint_path: str | None = None

    def to_wire(self) -> dict[str, str | None]:
        return {"name": self.name, "base": self.base, "checkpoint_path": self.checkpoint_path}


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    code="model_not_found", param="model")


def _base_names(settings: Settings) -> dict[str, str]:
    return {name.casefold(): name for name in settings.inference_models}


def _served_base(settings: Settings, base: str, name: str) -> str:
    served = _base_names(settings).get(base.casefold())
    if served is None:
        raise APIError(404, f"The model '{name}' was trained from '{base}', which this deployment does not serve; "
                            "add it to AGENT_RFT_INFERENCE_MODELS.", code="model_not_found", param="model")
    return served


def _project_job_ids(project_id: str):  # noqa: ANN202 - a SQL subquery
    return select(Job.id).where(Job.project_id == project_id)


def resolve(*, session: Session, settings: Settings, project_id: str, name: str) -> ResolvedModel:
    """The model a request names, or 404 `model_not_found`."""
    base = _base_names(settings).get(name.casefold())
    if base is not None:
        return ResolvedModel(name=base, base=base)
    found = fine_tuned_source(session, project_id, name)
    if found is None:
        raise model_not_found(name)
    checkpoint, job = found
    return ResolvedModel(name=name, base=_served_base(settings, base_model_under(session, job), name),
                         checkpoint_path=checkpoint.path)


def _model_object(name: str, created: int, owner: str) -> ModelObject:
    return ModelObject(id=name, created=created, owned_by=owner)


def list_models(*, session: Session, settings: Settings, project_id: str) -> ModelList:
    """The base models, then the project's fine-tuned models and checkpoints, newest first."""
    data = [_model_object(name, DEPLOYMENT_CREATED, SYSTEM_OWNER) for name in settings.inference_models]
    jobs = session.execute(
        select(Job.fine_tuned_model, Job.finished_at, Job.created_at)
        .where(Job.project_id == project_id, Job.fine_tuned_model.is_not(None), Job.model_deleted_at.is_(None))
        .order_by(Job.seq.desc()))
    data += [_model_object(name, unix(finished or created), project_id) for name, finished, created in jobs]
    checkpoints = session.execute(
        select(Checkpoint.fine_tuned_model_checkpoint, Checkpoint.created_at)
        .where(Checkpoint.job_id.in_(_project_job_ids(project_id))).order_by(Checkpoint.seq.desc()))
    data += [_model_object(name, unix(created), project_id) for name, created in checkpoints]
    return ModelList(data=data)


def get_model(*, session: Session, settings: Settings, project_id: str, name: str) -> ModelObject:
    base = _base_names(settings).get(name.casefold())
    if base is not None:
        return _model_object(base, DEPLOYMENT_CREATED, SYSTEM_OWNER)
    found = checkpoint_by_name(session, project_id, name) or shared_checkpoint(session, project_id, name)
    if found is not None:
        return _model_object(name, unix(found[0].created_at), found[1].project_id)
    job = job_by_model(session, project_id, name)
    if job is None:
        raise model_not_found(name)
    return _model_object(name, unix(job.finished_at or job.created_at), project_id)


def delete_model(*, session: Session, settings: Settings, project_id: str, name: str) -> ModelDeleted:
    """Delete a fine-tuned model: its name is no longer listed or served. Its checkpoints stay
    listed, callable and downloadable (they are the job's, and go with it)."""
    if name.casefold() in _base_names(settings):
        raise APIError(403, f"The model '{name}' is a base model of this deployment and cannot be deleted.",
                       code="model_not_deletable", param="model", type="invalid_request_error")
    if checkpoint_by_name(session, project_id, name) is not None:
        raise APIError(400, f"'{name}' is a checkpoint; checkpoints are kept with their job. Delete the "
                            "fine-tuned model (the name without ':ckpt-step-N') instead.",
                       code="model_not_deletable", param="model")
    if shared_checkpoint(session, project_id, name) is not None:
        raise APIError(403, f"'{name}' is a checkpoint another project shares with yours; only that project can "
                            "stop sharing it.", code="model_not_deletable", param="model", type="invalid_request_error")
    job = job_by_model(session, project_id, name)
    if job is None:
        raise model_not_found(name)
    job.model_deleted_at = utcnow()
    return ModelDeleted(id=name, deleted=True)

