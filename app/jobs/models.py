from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, BigIntPK, JSONType, StorableText, utcnow
from app.core.lifecycle import LeasedRun


class Job(LeasedRun, Base):
    """A fine-tuning job; its lease columns (enqueued_at, lease_*) come from LeasedRun."""

    __tablename__ = "jobs"
    kind, noun, id_param = "job", "fine-tuning job", "job_id"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(256))
    training_file: Mapped[str] = mapped_column(String(64), index=True)
    validation_file: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(32), index=True)
    # The validated `method` object, tool headers included (they are masked on the way out).
    method: Mapped[dict[str, Any]] = mapped_column(JSONType)
    seed: Mapped[int] = mapped_column(Integer)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(256), nullable=True, index=True)
    # DELETE /v1/models/{fine_tuned_model}: the name is no longer listed or served (its checkpoints are).
    model_deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    result_files: Mapped[list[str]] = mapped_column(JSONType, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    estimated_finish: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Where a new worker resumes: the saved training state and the steps it covers.
    resume_state: Mapped[str | None] = mapped_column(Text, nullable=True)
    completed_steps: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    resolved_hyperparameters: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # The variance diagnostic this job ran before training (x_open_model.diagnostic), once created.
    diagnostic_id: Mapped[str | None] = mapped_column(String(64), nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    level: Mapped[str] = mapped_column(String(8))
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(StorableText)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step_number: Mapped[int] = mapped_column(Integer)
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(256), index=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Directory of the checkpoint on the workers' shared storage.
    path: Mapped[str | None] = mapped_column(Text, nullable=True)
