"""Request and response shapes of a diagnostic's worker API, `/internal/v1/diagnostics/...`
(docs/internal-api.md); the claim, the lease and the finish error are every leased run's
(app/core/worker_schemas.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.core.deps import INT32_MAX
from app.core.worker_schemas import FinishError, Leased
from app.jobs.worker_schemas import ClaimedMethod


class ClaimedDiagnostic(BaseModel):
    id: str
    project_id: str
    job_id: str | None
    model: str
    training_file: str
    method: ClaimedMethod = Field(description="The stored method, tool headers included (unmasked).")
    runs_per_sample: int
    max_samples: int | None
    non_read_only_tools: Literal["call", "skip", "dry_run"] = "call"
    seed: int
    done_samples: list[int] = Field(description="Samples with every run stored: a worker that takes over skips them.")


class DiagnosticClaimResponse(BaseModel):
    lease_id: str
    lease_expires_at: int
    diagnostic: ClaimedDiagnostic


class DiagnosticRolloutRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    trace_id: str = Field(min_length=1, max_length=128)
    sample_index: int = Field(ge=0, le=INT32_MAX)
    run_index: int = Field(ge=0, le=INT32_MAX)
    reward: float | None = None
    finish_reason: str | None = Field(None, max_length=64)


class DiagnosticRolloutPush(Leased):
    records: list[DiagnosticRolloutRecord] = Field(default_factory=list, max_length=10000)
    samples_total: int | None = Field(None, ge=0, description="Samples this run covers (after max_samples).")
    load_basis: dict[str, Any] | None = Field(
        None, description="Batch and group sizes per compute_multiplier, as the trainer resolves them, for the "
                          "load projection.")


class DiagnosticRolloutResult(BaseModel):
    stored: int
    samples_done: int
    rollouts_done: int


class DiagnosticFinishPush(Leased):
    status: Literal["succeeded", "failed", "cancelled"]
    error: FinishError | None = None


class DiagnosticFinishResult(BaseModel):
    status: str


class JobDiagnostic(BaseModel):
    """The diagnostic a job runs before training, and whether this call created it."""

    id: str
    status: str
    created: bool
