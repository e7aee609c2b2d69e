"""Checkpoint permissions: the project that owns a checkpoint shares it with other projects, which
may then serve it and start jobs from it (app/jobs/lineage.py reads the permissions on every
lookup). Only the owner lists, grants and revokes; to any other project the checkpoint is unknown
(404, as for a model that does not exist)."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.auth.models import Project
from app.core.db import unix
from app.core.errors import APIError, bad_request, not_found
from agent_rft.ids import new_id
from app.core.pagination import ListPage, page_by
from app.jobs.models import Checkpoint, CheckpointPermission, Job
from app.jobs.schemas import CheckpointPermissionDeleted, CheckpointPermissionObject

Order = Literal["ascending", "descending"]
PERMISSION_ID_PREFIX = "cp_"


def checkpoint_not_found(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    code="model_not_found", param="fine_tuned_model_checkpoint")


def to_schema(permission: CheckpointPermission) -> CheckpointPermissionObject:
    return CheckpointPermissionObject(id=permission.id, created_at=unix(permission.created_at),
                                      project_id=permission.project_id)


def _require_owned_checkpoint(session: Session, project_id: str, name: str, *, lock: bool = False) -> None:
    """404 unless `name` is a checkpoint of the project's own jobs (a shared one is not enough).
    `lock` holds its rows until commit: two grants of one checkpoint at once then run one after
    the other, and the second finds the first's permission instead of a unique-key violation."""
    stmt = (select(Checkpoint.id).join(Job, Job.id == Checkpoint.job_id)
            .where(Job.project_id == project_id, Checkpoint.fine_tuned_model_checkpoint == name))
    if lock:
        stmt = stmt.with_for_update(of=Checkpoint)
    if not session.scalars(stmt).all():
        raise checkpoint_not_found(name)


def _check_projects(session: Session, owner_id: str, project_ids: list[str]) -> None:
    """Every project exists and is not the owner (which has the checkpoint already): else 400."""
    if owner_id in project_ids:
        raise bad_request(f"The checkpoint belongs to project '{owner_id}'; share it with other projects.",
                          param="project_ids", code="invalid_project")
    known = set(session.scalars(select(Project.id).where(Project.id.in_(project_ids))))
    unknown = [p for p in project_ids if p not in known]
    if unknown:
        raise bad_request(f"No such project: '{unknown[0]}'.", param="project_ids", code="invalid_project")


def _permissions_of(owner_id: str, name: str):  # noqa: ANN202 - a SQL select
    return select(CheckpointPermission).where(CheckpointPermission.owner_project_id == owner_id,
                                              CheckpointPermission.fine_tuned_model_checkpoint == name)


def grant(
    *, session: Session, project_id: str, name: str, project_ids: list[str]
) -> ListPage[CheckpointPermissionObject]:
    """Share the project's checkpoint `name` with `project_ids`, in their order; a project that has
    it already keeps its permission (the same id), so a repeated request creates nothing."""
    _require_owned_checkpoint(session, project_id, name, lock=True)
    wanted = list(dict.fromkeys(project_ids))
    _check_projects(session, project_id, wanted)
    existing = session.scalars(_permissions_of(project_id, name)
                               .where(CheckpointPermission.project_id.in_(wanted)))
    by_project = {p.project_id: p for p in existing}
    for grantee in wanted:
        if grantee not in by_project:
            by_project[grantee] = CheckpointPermission(id=new_id(PERMISSION_ID_PREFIX), owner_project_id=project_id,
                                                       fine_tuned_model_checkpoint=name, project_id=grantee)
            session.add(by_project[grantee])
    session.flush()
    return ListPage[CheckpointPermissionObject].of([to_schema(by_project[g]) for g in wanted], False)


def list_permissions(
    *, session: Session, project_id: str, name: str, grantee: str | None, after: str | None, limit: int,
    order: Order,
) -> ListPage[CheckpointPermissionObject]:
    """The checkpoint's permissions, newest first unless `order` is "ascending"; `grantee` keeps
    only the one of that project."""
    _require_owned_checkpoint(session, project_id, name)
    stmt = _permissions_of(project_id, name)
    if grantee is not None:
        stmt = stmt.where(CheckpointPermission.project_id == grantee)
    rows, has_more = page_by(session, stmt, order=(CheckpointPermission.seq,), cursor=CheckpointPermission.id,
                             after=after, limit=limit, descending=order == "descending", noun="checkpoint permission")
    return ListPage[CheckpointPermissionObject].of([to_schema(r) for r in rows], has_more)


def revoke(*, session: Session, project_id: str, name: str, permission_id: str) -> CheckpointPermissionDeleted:
    """Stop sharing: from the next request on, the project it named can neither serve the
    checkpoint nor start a job from it."""
    _require_owned_checkpoint(session, project_id, name)
    permission = session.scalar(_permissions_of(project_id, name)
                                .where(CheckpointPermission.id == permission_id))
    if permission is None:
        raise not_found("checkpoint permission", permission_id, param="permission_id")
    session.delete(permission)
    session.flush()
    return CheckpointPermissionDeleted(id=permission_id)
