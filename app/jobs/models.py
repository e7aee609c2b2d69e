"""A fine-tuning job and what its run produces: events, checkpoints, and what workers push back
through the worker API (per-step metrics, rollout records, the idempotency keys of their events)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
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
    # The validated `method` object; its tool and grader header values sealed (app/jobs/tool_headers.py).
    method: Mapped[dict[str, Any]] = mapped_column(JSONType)
    seed: Mapped[int] = mapped_column(Integer)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType, nullable=True)
    # The checked `integrations` (Weights & Biases); the W&B key is the project's, never stored here.
    integrations: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
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


class JobStep(Base):
    """One training step's metrics event `data`, exactly as the worker reported it."""

    __tablename__ = "job_steps"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_job_steps_job_step"),)

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    data: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class JobMetric(Base):
    """Append-only numeric metrics keyed by (job, step, key), e.g. `scores.train_reward_mean`.
    The unique index leads with (job_id, key), so reading one key's series over the steps is an
    index range scan."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "key", "step", name="uq_job_metrics_job_key_step"),)

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(String(255))
    value: Mapped[float] = mapped_column(Float)


class JobRollout(Base):
    """One graded rollout (episode) of a training or validation step."""

    __tablename__ = "job_rollouts"
    __table_args__ = (
        UniqueConstraint("job_id", "trace_id", name="uq_job_rollouts_job_trace"),
        Index("ix_job_rollouts_job_step", "job_id", "step"),
        # The dashboard's rollout browser filtered by sample (migration 0005).
        Index("ix_job_rollouts_job_sample", "job_id", "sample_index", "step"),
    )

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    split: Mapped[str] = mapped_column(String(8))
    trace_id: Mapped[str] = mapped_column(String(128))
    sample_index: Mapped[int] = mapped_column(Integer)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tool_calls: Mapped[int] = mapped_column(Integer, default=0)
    data: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WorkerEventKey(Base):
    """The idempotency key a worker chose for an event it pushed: a retried push finds it here."""

    __tablename__ = "worker_event_keys"
    __table_args__ = (UniqueConstraint("job_id", "key", name="uq_worker_event_keys_job_key"),)

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    event_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CheckpointPermission(Base):
    """A checkpoint shared by the project that owns it with another project, which may then serve
    it and fine-tune from it. Keyed by the checkpoint's name, not its row: a resumed job writes the
    checkpoint of a step again (a new row, the same name), and the share still holds. A pruned
    checkpoint's name no longer resolves, so its permissions grant nothing."""

    __tablename__ = "checkpoint_permissions"
    __table_args__ = (
        UniqueConstraint("fine_tuned_model_checkpoint", "project_id",
                         name="uq_checkpoint_permissions_fine_tuned_model_checkpoint"),
    )

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    # The project that owns the checkpoint: the only one that may list, grant or revoke.
    owner_project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(256))
    # The project it is shared with (the API's `project_id`).
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
