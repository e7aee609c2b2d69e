from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, utcnow


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class IntegrationSecret(Base):
    """A project's credential for one integration type (`wandb`: its W&B API key), sealed
    (`fernet:…`, app/core/crypto.py); opened only for the worker that claims one of the project's
    jobs using that integration, never shown."""

    __tablename__ = "integration_secrets"

    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    integration: Mapped[str] = mapped_column(String(32), primary_key=True)
    sealed: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    # Only a SHA-256 digest of the key is stored: keys are 256-bit random, so a fast hash is
    # enough to make the database useless for recovering them.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # First characters, for recognising a key in listings ("sk-Ab3d…").
    display_prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # A key past its expiry answers 401, as a revoked one does.
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Updated at most once a minute per key (LAST_USED_RESOLUTION), not on every request.
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
