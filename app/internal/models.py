"""What workers push back through the internal API: per-step metrics, rollout records, and the
idempotency keys of their events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Float, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, BigIntPK, JSONType, utcnow


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
