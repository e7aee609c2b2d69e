"""A job's Weights & Biases run (its `wandb` integration): every step's metrics, logged with the
names of the job's metrics events, under the run id = the job id, so that a worker restart or a
pause and resume continues the same W&B run (`resume="allow"`).

Logging to W&B is a convenience: a failure here (no network, a bad key, W&B down, `wandb` not
installed) never fails the job. The first one is reported once as a warn event on the job, and
logging stops for the rest of this claim. The project's API key goes to wandb through this run's
settings only (never the process environment, which the next job of another project would
inherit), and is never logged."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from app.jobs.schemas import method_block
from app.jobs.tool_headers import public_headers
from app.jobs.worker_schemas import ClaimedJob

log = logging.getLogger(__name__)
Warn = Callable[[str, dict[str, Any]], None]
SEPARATOR = "/"  # W&B groups "scores/train_reward_mean" under a "scores" section
EXIT_CODES = {"failed": 1}  # a paused, cancelled or given-back run ends cleanly; a resume reopens it


def flat_metrics(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A metrics event's `data` as W&B values: {"scores": {"train_reward_mean": 0.4}} ->
    {"scores/train_reward_mean": 0.4}; numbers only, `step` being the x-axis itself."""
    flat: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_metrics(value, name + SEPARATOR))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and name != "step":
            flat[name] = value
    return flat


def run_config(job: ClaimedJob, resolved: dict[str, Any] | None) -> dict[str, Any]:
    """What the run records as its config: the job's settings, tool and grader headers masked."""
    method = public_headers(job.method.model_dump(mode="json"))
    return {"model": job.model, "training_file": job.training_file, "validation_file": job.validation_file,
            "method": method, "hyperparameters": resolved or method_block(method).get("hyperparameters"),
            "seed": job.seed}


class WandbRun:
    """The job's W&B run on this worker: opened at the first step, finished when the claim ends."""

    def __init__(self, job: ClaimedJob, options: dict[str, Any], warn: Warn) -> None:
        self.job, self.options, self.warn = job, options, warn
        self.key = job.integration_keys.get("wandb")  # the project's W&B API key
        self.run: Any = None
        self.broken = False  # after the first failure, W&B is left alone for the rest of the claim

    def log_step(self, step: int, metrics: dict[str, Any], resolved: dict[str, Any] | None) -> None:
        if self.broken:
            return
        try:
            if self.run is None:
                self.run = self._open(resolved)
            self.run.log(flat_metrics(metrics), step=step)
        except Exception as exc:  # noqa: BLE001 - W&B never fails the job
            self._fail("log to", exc)

    def finish(self, status: str) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=EXIT_CODES.get(status, 0))
        except Exception as exc:  # noqa: BLE001
            self._fail("finish", exc)
        finally:
            self.run = None

    def _open(self, resolved: dict[str, Any] | None) -> Any:
        import wandb

        if not self.key:
            raise RuntimeError("the project has no W&B API key anymore (agent-rft projects set-wandb-key)")
        options = self.options
        return wandb.init(
            project=options["project"], entity=options.get("entity"), name=options.get("name") or self.job.id,
            tags=options.get("tags") or None, id=self.job.id, resume="allow", config=run_config(self.job, resolved),
            # init_timeout stays wandb's (WANDB_INIT_TIMEOUT, 90 s): an unreachable W&B delays one step by that much.
            settings=wandb.Settings(api_key=self.key, silent=True),
            reinit="finish_previous",  # a run an earlier claim in this process left open is closed first
        )

    def _fail(self, what: str, exc: Exception) -> None:
        self.broken = True
        message = f"Weights & Biases: could not {what} run {self.job.id} ({type(exc).__name__}: " \
                  f"{_without(str(exc), self.key)[:500]}); training goes on without W&B logging."
        log.warning("%s", message)
        try:
            self.warn(message, {"integration": "wandb"})
        except Exception:  # noqa: BLE001 - the warning is best effort too
            log.exception("could not report the W&B failure of job %s", self.job.id)


def _without(text: str, secret: str | None) -> str:
    """An error message with the key cut out, should a library ever echo it."""
    return text.replace(secret, "****") if secret else text


def wandb_run(job: ClaimedJob, warn: Warn) -> WandbRun | None:
    """The job's W&B run, or None when it has no `wandb` integration."""
    options = next((item.wandb.model_dump() for item in job.integrations if item.type == "wandb"), None)
    return WandbRun(job, options, warn) if options is not None else None
