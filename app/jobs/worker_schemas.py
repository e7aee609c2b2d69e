"""Request and response shapes of a job's worker API, `/internal/v1/jobs/...` (docs/internal-api.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.core.worker_schemas import FinishError, Leased
from app.jobs.schemas import Integration, Method, Split


class ClaimedMethod(Method):
    """A claimed run's method, as stored: `reinforcement` (jobs and diagnostics), `supervised` or
    `dpo` (jobs), with every default filled in; the block its type names is always there."""

    @model_validator(mode="after")
    def _has_its_block(self) -> ClaimedMethod:
        if getattr(self, self.type) is None:
            raise ValueError(f"a {self.type} method without its '{self.type}' block")
        return self


class StartFrom(BaseModel):
    """The fine-tuned model a job starts from (its `model` is an `ft:` name)."""

    checkpoint_path: str
    training_mode: Literal["lora", "full"] = Field(description="lora: an adapter on base_model; full: a model "
                                                                "directory")
    base_model: str


class ClaimedJob(BaseModel):
    id: str
    project_id: str
    project_name: str
    model: str
    training_file: str
    validation_file: str | None
    method: ClaimedMethod = Field(description="The stored method, tool headers included (unmasked).")
    seed: int
    suffix: str | None
    resume_state: str | None
    completed_steps: int
    resolved_hyperparameters: dict[str, Any] | None
    start_from: StartFrom | None = None
    integrations: list[Integration] = Field(default_factory=list, description="The job's integrations (W&B).")
    # Opened from the project's sealed keys, only for the integrations the job uses; repr=False keeps
    # them out of any log line or traceback that prints the claim.
    integration_keys: dict[str, str] = Field(default_factory=dict, repr=False, description=(
        "The project's key for each integration the job uses (`wandb`: its W&B API key), in plain text."))


class ClaimResponse(BaseModel):
    lease_id: str
    lease_expires_at: int
    job: ClaimedJob


class StepMetrics(BaseModel):
    """The `data` of an OpenAI metrics event, plus this service's `tools` and `train` blocks."""

    model_config = ConfigDict(extra="allow")

    step: int | None = Field(None, ge=0)
    total_steps: int | None = Field(None, ge=0)
    scores: dict[str, Any] = Field(default_factory=dict)
    usage: dict[str, Any] = Field(default_factory=dict)
    errors: dict[str, Any] = Field(default_factory=dict)
    timing: dict[str, Any] = Field(default_factory=dict)
    tools: dict[str, Any] = Field(default_factory=dict)
    train: dict[str, Any] = Field(default_factory=dict)


class StepPush(Leased):
    metrics: StepMetrics


class StepResult(BaseModel):
    step: int
    created: bool


class EventPush(Leased):
    key: str = Field(min_length=1, max_length=255, description="Idempotency key chosen by the worker.")
    level: Literal["info", "warn", "error"] = "info"
    message: str = Field(min_length=1, max_length=20000)
    data: dict[str, Any] | None = None


class EventResult(BaseModel):
    id: str
    created: bool


class RolloutRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    trace_id: str = Field(min_length=1, max_length=128)
    sample_index: int = Field(ge=0)
    reward: float | None = None
    finish_reason: str | None = Field(None, max_length=64)


class RolloutPush(Leased):
    step: int = Field(ge=0)
    split: Split
    records: list[RolloutRecord] = Field(max_length=10000)


class RolloutResult(BaseModel):
    stored: int


class CheckpointPush(Leased):
    path: str = Field(min_length=1, max_length=4096, description="Directory on the shared checkpoint storage.")
    metrics: dict[str, Any] = Field(default_factory=dict)


class CheckpointResult(BaseModel):
    id: str
    created: bool
    delete_paths: list[str]


class StatePush(Leased):
    completed_steps: int = Field(ge=0)
    resume_state: str = Field(min_length=1, max_length=4096, description="Path of the saved training state.")
    resolved_hyperparameters: dict[str, Any] | None = None
    trained_tokens: int | None = Field(None, ge=0)


class StateResult(BaseModel):
    completed_steps: int


class FinishPush(Leased):
    status: Literal["succeeded", "failed", "paused", "cancelled"]
    error: FinishError | None = None
    trained_tokens: int | None = Field(None, ge=0)


class FinishResult(BaseModel):
    status: str
    fine_tuned_model: str | None
