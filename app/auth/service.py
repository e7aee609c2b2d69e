"""Projects and API keys. Keys are shown once, stored as SHA-256 digests; they can be listed
(prefix and dates, never the secret), revoked, and given an expiry."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from app.auth.models import ApiKey, IntegrationSecret, Project
from app.core.crypto import SecretBox
from app.core.db import utcnow
from agent_rft.ids import new_id

KEY_PREFIX = "sk-"
LAST_USED_RESOLUTION = timedelta(minutes=1)  # `last_used_at` is this precise: no write per request
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


@dataclass(frozen=True)
class KeyInfo:
    """What a listing shows of a key: never the secret, nor its hash."""

    key_id: str
    display_prefix: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None

    def state(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.expires_at is not None and _aware(self.expires_at) <= now else "active"


def _aware(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were stored in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=utcnow().tzinfo)


def _new_key(session: Session, project: Project, expires_at: datetime | None = None) -> CreatedKey:
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(
        id=new_id("key_"), project_id=project.id, key_hash=hash_key(secret), display_prefix=secret[:7],
        expires_at=expires_at,
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


def _project(session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise ProjectError(f"No project named '{name}'.")
    return project


def create_key(*, session: Session, project_name: str, expires_at: datetime | None = None) -> CreatedKey:
    return _new_key(session, _project(session, project_name), expires_at)


def list_keys(*, session: Session, project_name: str) -> list[KeyInfo]:
    """The project's keys, oldest first, revoked and expired ones included."""
    project = _project(session, project_name)
    keys = session.scalars(select(ApiKey).where(ApiKey.project_id == project.id).order_by(ApiKey.created_at))
    return [KeyInfo(k.id, k.display_prefix, k.created_at, k.last_used_at, k.expires_at, k.revoked_at) for k in keys]


MAX_INTEGRATION_KEY_LENGTH = 512


def set_integration_key(*, session: Session, project_name: str, integration: str, key: str | None,
                        box: SecretBox) -> None:
    """Store the project's credential for `integration` (`wandb`: its W&B API key) sealed; None
    removes it. Jobs already created with that integration use whatever key the project has when a
    worker claims them."""
    project = _project(session, project_name)
    stored = session.get(IntegrationSecret, (project.id, integration))
    if key is None:
        if stored is not None:
            session.delete(stored)
        return
    key = key.strip()
    if not key or len(key) > MAX_INTEGRATION_KEY_LENGTH or any(c.isspace() for c in key):
        raise ProjectError(f"An integration key is 1-{MAX_INTEGRATION_KEY_LENGTH} characters without spaces "
                           "(https://wandb.ai/authorize shows a W&B key).")
    if stored is None:
        session.add(IntegrationSecret(project_id=project.id, integration=integration, sealed=box.seal(key)))
    else:
        stored.sealed = box.seal(key)


def revoke_key(*, session: Session, key_id: str) -> KeyInfo:
    """Revoke a key (by its id, as `keys list` shows it); it answers 401 from the next request."""
    key = session.scalar(select(ApiKey).where(ApiKey.id == key_id).with_for_update())
    if key is None:
        raise ProjectError(f"No API key with id '{key_id}'.")
    key.revoked_at = key.revoked_at or utcnow()
    return KeyInfo(key.id, key.display_prefix, key.created_at, key.last_used_at, key.expires_at, key.revoked_at)


def authenticate(*, session: Session, secret: str) -> Principal | None:
    """The principal of a live key (not revoked, not expired); notes its use once a minute."""
    if not secret.startswith(KEY_PREFIX):
        return None
    now = utcnow()
    key = session.scalar(select(ApiKey).where(
        ApiKey.key_hash == hash_key(secret), ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now)))
    if key is None:
        return None
    if key.last_used_at is None or _aware(key.last_used_at) < now - LAST_USED_RESOLUTION:
        key.last_used_at = now
    return Principal(project_id=key.project_id, key_id=key.id)
