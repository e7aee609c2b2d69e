"""An eval (its item schema and testing criteria), its runs (leased to workers like jobs and
diagnostics), and each run's output items (one per data-source item and sample)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, BigIntPK, JSONType, utcnow
from app.core.lifecycle import LeasedRun


class Eval(Base):
    __tablename__ = "evals"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    # {"type": "custom", "item_schema": {...}, "include_sample_schema": bool}, as created.
    data_source_config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # The grader objects, in order; header values sealed as on a job's grader (app/jobs/tool_headers.py).
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EvalRun(LeasedRun, Base):
    """One model (or given samples) over the eval's items; lease columns from LeasedRun. The status
    is stored in the lifecycle's words (queued, running, succeeded, failed, cancelled) and shown in
    OpenAI's (queued, in_progress, completed, failed, canceled)."""

    __tablename__ = "eval_runs"
    kind, noun, id_param = "eval_run", "eval run", "run_id"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    eval_id: Mapped[str] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"), index=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(256))  # "" for a jsonl run (samples made elsewhere)
    # The data source as created; the header values of x_tools sealed.
    data_source: Mapped[dict[str, Any]] = mapped_column(JSONType)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType, nullable=True)
    status: Mapped[str] = mapped_column(String(32), index=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    items_total: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # result_counts, per_testing_criteria_results, per_model_usage: recomputed from the output items.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class EvalOutputItem(Base):
    """One sample of one data-source item, graded by every testing criterion. (item, sample) is
    stored once: a worker that takes a run over re-runs only what is missing."""

    __tablename__ = "eval_output_items"
    __table_args__ = (UniqueConstraint("run_id", "item_index", "sample_index", name="uq_eval_output_items_run_item"),)

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("eval_runs.id", ondelete="CASCADE"), index=True)
    eval_id: Mapped[str] = mapped_column(String(64))
    item_index: Mapped[int] = mapped_column(Integer)  # OpenAI's datasource_item_id
    sample_index: Mapped[int] = mapped_column(Integer)  # 0 .. x_samples_per_item - 1
    trace_id: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))  # pass | fail | error
    datasource_item: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # [{"name", "type", "score", "passed", "error"?}], one per testing criterion, in the eval's order.
    results: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    # OpenAI's sample: input, output, finish_reason, model, usage, error, seed, temperature, top_p, max_completion_tokens.
    sample: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # The rollout record (workers/engine/rollout.RolloutRecord.summary()): messages, tool_calls, tokens,
    # wall_time_s, turns, finish_reason; None for a jsonl run.
    trajectory: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
