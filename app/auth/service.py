"""Projects and API keys. Keys are shown once, stored as SHA-256 digests."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.auth.models import ApiKey, Project
from app.core.ids import new_id

KEY_PREFIX = "sk-"
_PROJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class ProjectError(ValueError):
    pass


@dataclass(frozen=True)
class CreatedKey:
    key_id: str
    project_id: str
    project_name: str
    secret: str  # the only time the plain key exists outside the caller's hands


@dataclass(frozen=True)
class Principal:
    """Who is calling: every object the request touches is scoped to this project."""

    project_id: str
    key_id: str


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _new_key(session: Session, project: Project) -> CreatedKey:
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(
        id=new_id("key_"), project_id=project.id, key_hash=hash_key(secret), display_prefix=secret[:7]
    )
    session.add(key)
    session.flush()
    return CreatedKey(key_id=key.id, project_id=project.id, project_name=project.name, secret=secret)


def create_project(*, session: Session, name: str) -> CreatedKey:
    if not _PROJECT_NAME.match(name):
        raise ProjectError(
            "Project names are 1-100 characters of letters, digits, '_', '.' or '-', starting with a letter or digit."
        )
    if session.scalar(select(Project).where(Project.name == name)) is not None:
        raise ProjectError(f"A project named '{name}' already exists.")
    project = Project(id=new_id("proj_"), name=name)
    session.add(project)
    session.flush()
    return _new_key(session, project)


def create_key(*, session: Session, project_name: str) -> CreatedKey:
    project = session.scalar(select(Project).where(Project.name == project_name))
    if project is None:
        raise ProjectError(f"No project named '{project_name}'.")
    return _new_key(session, project)


def authenticate(*, session: Session, secret: str) -> Principal | None:
    if not secret.startswith(KEY_PREFIX):
        return None
    key = session.scalar(
        select(ApiKey).where(ApiKey.key_hash == hash_key(secret), ApiKey.revoked_at.is_(None))
    )
    if key is None:
        return None
    return Principal(project_id=key.project_id, key_id=key.id)
