"""The shapes every leased run's worker API shares (jobs and diagnostics): the claim, the lease
each later call names, the heartbeat's answer, and the error a worker reports when it finishes
with a failure."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# What a heartbeat tells the worker: go on, save state and stop (jobs only), or stop now.
Action = Literal["continue", "pause", "cancel"]


class ClaimRequest(BaseModel):
    worker_id: str = Field(min_length=1, max_length=255, description="Identifies the process running the task.")


class Leased(BaseModel):
    """Every call after the claim names the lease it holds."""

    lease_id: str = Field(min_length=1, max_length=64)


class HeartbeatResponse(BaseModel):
    action: Action
    lease_expires_at: int


class FinishError(BaseModel):
    code: str = Field(min_length=1, max_length=128)
    message: str = Field(min_length=1, max_length=20000)
    param: str | None = None


# The run's error when a worker reports a failure without one.
UNEXPLAINED_FAILURE = {"code": "worker_error", "message": "The worker reported a failure without details.",
                       "param": None}
