"""Request and response shapes of /v1/fine_tuning/alpha/diagnostics (this service's extension)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.diagnostics.options import DiagnosticRunOptions
from app.jobs.schemas import JobError, Method, check_metadata


class DiagnosticCreate(DiagnosticRunOptions):
    """The inputs of a job (`model`, `training_file`, `method`, `seed`, `metadata`) plus the
    diagnostic's `runs_per_sample` and `max_samples`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1)
    method: Method | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(metadata)


class DiagnosticProgress(BaseModel):
    samples_done: int
    samples_total: int | None
    rollouts_done: int
    rollouts_total: int | None


class DiagnosticObject(BaseModel):
    id: str
    object: Literal["fine_tuning.diagnostic"] = "fine_tuning.diagnostic"
    created_at: int
    started_at: int | None
    finished_at: int | None
    status: str
    error: JobError | None
    organization_id: str
    model: str
    training_file: str
    method: dict[str, Any]
    runs_per_sample: int
    max_samples: int | None
    non_read_only_tools: str = "call"
    seed: int
    metadata: dict[str, str] | None = None
    fine_tuning_job_id: str | None = Field(None, description="The job that ran this diagnostic before training.")
    progress: DiagnosticProgress
    summary: dict[str, Any] | None = Field(None, description="Set once the diagnostic has ended "
                                                             "(see docs/diagnostics.md).")
    verdict: dict[str, Any] | None = None
    samples: list[dict[str, Any]] | None = Field(None, description="Per-sample results, once the diagnostic has ended.")


class DiagnosticRolloutObject(BaseModel):
    """One run of one sample, shaped like a job's rollout record (`fine_tuning.job.rollout`)."""

    object: Literal["fine_tuning.diagnostic.rollout"] = "fine_tuning.diagnostic.rollout"
    id: str = Field(description="The rollout's trace_id.")
    sample_index: int
    run_index: int
    reward: float | None
    finish_reason: str | None
    tool_calls: int
    data: dict[str, Any]
