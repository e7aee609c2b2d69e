"""The diagnostic's own knobs, shared by `POST /v1/fine_tuning/alpha/diagnostics` and a job's
`x_open_model.diagnostic` option. No imports from the jobs package, which imports this."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_RUNS_PER_SAMPLE = 3
MAX_RUNS_PER_SAMPLE = 64
MAX_SAMPLES_LIMIT = 100_000


class DiagnosticRunOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runs_per_sample: int = Field(
        DEFAULT_RUNS_PER_SAMPLE, ge=2, le=MAX_RUNS_PER_SAMPLE,
        description="Rollouts per sample; at least 2, since a spread needs two scores.",
    )
    max_samples: int | None = Field(
        None, ge=1, le=MAX_SAMPLES_LIMIT,
        description="Diagnose at most this many rows (a seeded random subset); default every row.",
    )
    non_read_only_tools: Literal["call", "skip", "dry_run"] = Field(
        "call", description="Calls of tools not declared read_only: `call` them as training would; `skip` them "
                            "(the model reads an error output saying the call was skipped); or `dry_run`: send "
                            'them with `"dry_run": true` in the body, for a server that then changes nothing.',
    )


class JobDiagnosticOptions(DiagnosticRunOptions):
    """`method.reinforcement.x_open_model.diagnostic`: run the diagnostic before training."""

    drop_zero_signal: bool = Field(
        False, description="Train only on samples whose runs had mixed scores (rows not diagnosed are kept).",
    )
