"""Request and response shapes of an eval run's worker API, `/internal/v1/eval_runs/...`
(docs/internal-api.md); the claim, the lease and the finish error are every leased run's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.core.deps import INT32_MAX
from app.core.worker_schemas import FinishError, Leased
from app.jobs.worker_schemas import StartFrom


class ClaimedRun(BaseModel):
    id: str
    eval_id: str
    project_id: str
    model: str
    start_from: StartFrom | None = Field(None, description="The weights an `ft:` model stands for.")
    data_source: dict[str, Any] = Field(description="As created, tool header values in plain text.")
    testing_criteria: list[dict[str, Any]] = Field(description="The eval's graders, header values in plain text.")
    item_schema: dict[str, Any] = Field(default_factory=dict, description="The eval's JSON schema of an item.")
    done: list[tuple[int, int]] = Field(description="(item, sample) pairs already stored: a worker that takes over "
                                                    "skips them.")


class RunClaimResponse(BaseModel):
    lease_id: str
    lease_expires_at: int
    run: ClaimedRun


class OutputItemPush(BaseModel):
    model_config = ConfigDict(extra="forbid")

    item_index: int = Field(ge=0, le=INT32_MAX)
    sample_index: int = Field(ge=0, le=INT32_MAX)
    trace_id: str = Field(min_length=1, max_length=128)
    status: Literal["pass", "fail", "error"]
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]]
    sample: dict[str, Any]
    trajectory: dict[str, Any] | None = None


class OutputItemsPush(Leased):
    items: list[OutputItemPush] = Field(default_factory=list, max_length=10000)
    items_total: int | None = Field(None, ge=0, description="Items x samples the run covers, once the worker knows.")


class OutputItemsResult(BaseModel):
    stored: int
    done: int


class RunFinishPush(Leased):
    status: Literal["succeeded", "failed", "cancelled"]
    error: FinishError | None = None


class RunFinishResult(BaseModel):
    status: str
