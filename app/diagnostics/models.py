"""A variance diagnostic and the rollouts its workers pushed back."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, BigIntPK, JSONType, utcnow
from app.core.lifecycle import LeasedRun


class Diagnostic(LeasedRun, Base):
    """A variance diagnostic; its lease columns (enqueued_at, lease_*) come from LeasedRun."""

    __tablename__ = "diagnostics"
    kind, noun, id_param = "diagnostic", "diagnostic", "diagnostic_id"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    # Set when a job runs this diagnostic before training (the job's worker runs it, not the broker).
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True, index=True)
    model: Mapped[str] = mapped_column(String(256))
    training_file: Mapped[str] = mapped_column(String(64), index=True)
    # The validated `method` object, header values sealed, as on a job.
    method: Mapped[dict[str, Any]] = mapped_column(JSONType)
    runs_per_sample: Mapped[int] = mapped_column(Integer)
    max_samples: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Calls of tools not declared read_only: call, skip or dry_run (app/diagnostics/options.py).
    non_read_only_tools: Mapped[str] = mapped_column(String(16), default="call", server_default="call")
    seed: Mapped[int] = mapped_column(Integer)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType, nullable=True)
    status: Mapped[str] = mapped_column(String(32), index=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # Progress: samples to run (known once the file is validated), samples with every run stored.
    samples_total: Mapped[int | None] = mapped_column(Integer, nullable=True)
    samples_done: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    rollouts_done: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # What the worker resolved for the load projection (batch and group sizes per compute_multiplier).
    load_basis: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # Per-sample results, summary and verdict, computed by the control plane when the run ends.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class DiagnosticRollout(Base):
    """One graded run of one sample. (sample_index, run_index) is stored once: a worker that
    re-runs a sample after taking over a diagnostic cannot count it twice."""

    __tablename__ = "diagnostic_rollouts"
    __table_args__ = (
        UniqueConstraint("diagnostic_id", "trace_id", name="uq_diagnostic_rollouts_diagnostic_trace"),
        UniqueConstraint("diagnostic_id", "sample_index", "run_index", name="uq_diagnostic_rollouts_diagnostic_run"),
    )

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    diagnostic_id: Mapped[str] = mapped_column(ForeignKey("diagnostics.id", ondelete="CASCADE"))
    trace_id: Mapped[str] = mapped_column(String(128))
    sample_index: Mapped[int] = mapped_column(Integer)
    run_index: Mapped[int] = mapped_column(Integer)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tool_calls: Mapped[int] = mapped_column(Integer, default=0)
    data: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
