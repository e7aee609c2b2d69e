"""`/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions`, as the `openai` SDK's
`client.fine_tuning.checkpoints.permissions` calls it (create, list or retrieve, delete)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.core.deps import CurrentKey, SessionDep
from app.core.pagination import ListPage
from app.jobs import permissions
from app.jobs.schemas import CheckpointPermissionCreate, CheckpointPermissionDeleted, CheckpointPermissionObject

# `:path`: a checkpoint's name carries its base model's name, which may hold a '/' (a Hub id).
router = APIRouter(prefix="/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint:path}/permissions",
                   tags=["fine-tuning"])

Limit = Annotated[int, Query(ge=1, le=100)]
ProjectFilter = Annotated[str | None, Query(min_length=1, max_length=64)]


@router.post("", response_model=ListPage[CheckpointPermissionObject])
def create_permissions(
    fine_tuned_model_checkpoint: str, body: CheckpointPermissionCreate, principal: CurrentKey, session: SessionDep
) -> ListPage[CheckpointPermissionObject]:
    """Share one of your project's checkpoints with other projects: they may serve it and fine-tune from it."""
    return permissions.grant(session=session, project_id=principal.project_id, name=fine_tuned_model_checkpoint,
                             project_ids=body.project_ids)


@router.get("", response_model=ListPage[CheckpointPermissionObject])
def list_permissions(
    fine_tuned_model_checkpoint: str,
    principal: CurrentKey,
    session: SessionDep,
    after: str | None = None,
    limit: Limit = 10,
    order: permissions.Order = "descending",
    project_id: ProjectFilter = None,
) -> ListPage[CheckpointPermissionObject]:
    """The projects one of your project's checkpoints is shared with."""
    return permissions.list_permissions(session=session, project_id=principal.project_id,
                                        name=fine_tuned_model_checkpoint, grantee=project_id, after=after,
                                        limit=limit, order=order)


@router.delete("/{permission_id}", response_model=CheckpointPermissionDeleted)
def delete_permission(
    fine_tuned_model_checkpoint: str, permission_id: str, principal: CurrentKey, session: SessionDep
) -> CheckpointPermissionDeleted:
    """Stop sharing a checkpoint with a project, from its next request on."""
    return permissions.revoke(session=session, project_id=principal.project_id, name=fine_tuned_model_checkpoint,
                              permission_id=permission_id)
