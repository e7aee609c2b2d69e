"""Celery tasks. `run_job` turns a queued job into a trained, checkpointed model, reporting
every step to the control plane over its internal API."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from app.diagnostics.worker_schemas import DiagnosticClaimResponse
from app.evals.worker_schemas import RunClaimResponse
from app.jobs.worker_schemas import ClaimResponse
from workers.celery_app import RUN_DIAGNOSTIC_TASK, RUN_EVAL_TASK, RUN_JOB_TASK, celery_app
from workers.control_client import (
    GIVEN_BACK,
    ControlPlaneClient,
    ControlPlaneUnreachable,
    Heartbeat,
    LeaseHeld,
    LeaseLost,
    NotClaimable,
    worker_failure,
    worker_id,
)
from workers.diagnostics import DiagnosticRun
from workers.metrics import record_step  # also starts the metrics server with the worker
from workers.integrations.wandb_run import wandb_run

log = logging.getLogger(__name__)
# One line per internal-API call would drown the worker's log; failures are logged by the client.
logging.getLogger("httpx").setLevel(logging.WARNING)
LEASE_RETRY_COUNTDOWN_S = 10
Claimed = TypeVar("Claimed", ClaimResponse, DiagnosticClaimResponse, RunClaimResponse)


def _run_claimed(task: Any, kind: str, run_id: str, claim: Callable[[ControlPlaneClient], Claimed],
                 work: Callable[[ControlPlaneClient, Claimed, Any], dict[str, Any]]) -> dict[str, Any]:
    """What every leased task does: claim `run_id` under a lease, then `work`. A lease another
    worker still holds (e.g. saving state after a pause) retries the task later; a run that can no
    longer be claimed (it ended meanwhile) is skipped."""
    from app.core.config import get_settings

    settings = get_settings()
    client = ControlPlaneClient(settings.api_url, settings.worker_token.get_secret_value(),
                                patience_s=settings.lease_seconds)
    try:
        try:
            claimed = claim(client)
        except (LeaseHeld, ControlPlaneUnreachable) as exc:
            raise task.retry(countdown=LEASE_RETRY_COUNTDOWN_S, exc=exc) from exc
        except NotClaimable as exc:
            log.info("%s %s not claimable: %s", kind, run_id, exc.message)
            return {f"{kind}_id": run_id, "status": "skipped", "reason": exc.message}
        return work(client, claimed, settings)
    finally:
        client.close()


@celery_app.task(name=RUN_JOB_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=360)
def run_job(self, job_id: str) -> dict[str, Any]:  # noqa: ANN001
    return _run_claimed(self, "job", job_id, lambda client: client.claim(job_id, worker_id()),
                        lambda client, claim, settings: JobRun(client, claim, settings).run())


@celery_app.task(name=RUN_DIAGNOSTIC_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=360)
def run_diagnostic(self, diagnostic_id: str) -> dict[str, Any]:  # noqa: ANN001
    """A variance diagnostic (docs/diagnostics.md): every sample run several times, graded, pushed."""

    def work(client: ControlPlaneClient, claim: DiagnosticClaimResponse, settings: Any) -> dict[str, Any]:
        return {"diagnostic_id": diagnostic_id, "status": asyncio.run(DiagnosticRun(client, claim, settings).run())}

    return _run_claimed(self, "diagnostic", diagnostic_id,
                        lambda client: client.claim_diagnostic(diagnostic_id, worker_id()), work)



@celery_app.task(name=RUN_EVAL_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=360)
def run_eval(self, run_id: str) -> dict[str, Any]:  # noqa: ANN001
    """An eval run (docs/evals.md): a model over the eval's items, or given samples, graded, pushed."""
    from workers.evals.run import EvalRunner

    def work(client: ControlPlaneClient, claim: RunClaimResponse, settings: Any) -> dict[str, Any]:
        return {"run_id": run_id, "status": asyncio.run(EvalRunner(client, claim, settings).run())}

    return _run_claimed(self, "eval_run", run_id, lambda client: client.claim_eval_run(run_id, worker_id()), work)

class JobRun:
    """One claimed job on this worker: heartbeat, data, starting weights, final report; the job's
    method trains it (workers/methods/)."""

    def __init__(self, client: ControlPlaneClient, claim: ClaimResponse, settings: Any) -> None:
        self.client, self.settings = client, settings
        self.job, self.lease_id = claim.job, claim.lease_id
        self.job_id = self.job.id
        self.heartbeat = Heartbeat(client, self.job_id, self.lease_id, interval_s=max(1.0, settings.lease_seconds / 4))
        self.work_dir = Path(settings.resolved_checkpoint_dir) / self.job_id
        # The job's W&B run (None without the integration); its one failure warning has one key per claim.
        self.wandb = wandb_run(self.job, lambda message, data: client.push_event(
            self.job_id, self.lease_id, f"{self.lease_id}:wandb", "warn", message, data))

    def run(self) -> dict[str, Any]:
        from workers.training.training_run import RunInterrupted
        from workers.spans import configure_from_environment

        configure_from_environment()  # OpenTelemetry spans, where OTEL_EXPORTER_OTLP_* says where to send them
        self.heartbeat.start()
        try:
            outcome = asyncio.run(self._train())
        except (RunInterrupted, ControlPlaneUnreachable, LeaseLost) as exc:
            return self._give_back(exc)
        except Exception as exc:  # noqa: BLE001 - anything that escapes the trainer fails the job, with the reason
            log.exception("job %s failed", self.job_id)
            error = worker_failure(exc)
            self._finish("failed", error=error)
            return {"job_id": self.job_id, "status": "failed"}
        finally:
            self.heartbeat.stop()
        if self.heartbeat.action != "lost":
            self._finish(outcome.status, error=outcome.error, trained_tokens=outcome.trained_tokens)
        else:
            self._end_integrations(outcome.status)
        return {"job_id": self.job_id, "status": outcome.status, "steps": outcome.completed_steps}

    def _give_back(self, exc: Exception) -> dict[str, Any]:
        """Stop without reporting an end: the control plane cannot be reached (or took the job
        away), and an outage of the control plane is no failure of the job. Its lease expires, and
        the watchdog re-queues it from the last saved step."""
        log.warning("job %s given back (%s): it resumes from its last saved step once its lease expires",
                    self.job_id, exc)
        self._end_integrations(GIVEN_BACK)
        return {"job_id": self.job_id, "status": GIVEN_BACK}

    def _end_integrations(self, status: str) -> None:
        if self.wandb is not None:
            self.wandb.finish(status)

    def _finish(self, status: str, **kwargs: Any) -> None:
        self._end_integrations(status)  # before the end is reported: a reader of the job finds the run complete
        try:
            self.client.finish(self.job_id, self.lease_id, status, **kwargs)
        except Exception:  # noqa: BLE001 - the watchdog re-queues a job whose worker cannot report
            log.exception("could not report the end of job %s", self.job_id)

    def hooks(self, resolved: dict[str, Any] | None) -> ControlHooks:
        """The trainer's reporting channel for this claim; `resolved`: the job's resolved hyperparameters."""
        return ControlHooks(self, resolved)

    def rows(self, file_id: str | None) -> list[dict[str, Any]]:
        return self.client.file_rows(file_id) if file_id else []

    async def _train(self) -> Any:
        from workers.methods import method_for

        return await method_for(self.job.method.type).train(self)

    @asynccontextmanager
    async def training_processes(self, loaded: Any, training_mode: str, trainer_args: dict[str, Any],
                                 hooks: ControlHooks, **follower_only: Any) -> AsyncIterator[Any]:
        """The job's training processes (docs/scaling.md): yields their group, rank 0 being this
        process, or None when the job trains in this process alone. Every other rank builds the
        method's trainer from `trainer_args` (and `follower_only`); they are stopped on the way out."""
        import torch

        from workers.methods import METHODS
        from workers.training.distributed.follower import FollowerJob, follow
        from workers.training.distributed.group import Rendezvous
        from workers.training.distributed.launch import TrainingProcesses, backend_for, free_port

        n = await self._process_count(loaded, hooks)
        if n == 1:
            yield None
            return
        on_gpu = loaded.device.type == "cuda"
        cores = torch.get_num_threads()
        threads = None if on_gpu else max(1, len(os.sched_getaffinity(0)) // n)
        job = self.job
        follower = FollowerJob(METHODS[job.method.type], job.model, job.start_from, method_block_of(job).x_open_model.dtype,
                               training_mode, threads, {**trainer_args, **follower_only})
        rendezvous = Rendezvous(free_port(), n, self.settings.training_rank_timeout_s, backend_for(loaded.device.type))
        processes = TrainingProcesses(rendezvous, follow, follower, self.work_dir)
        try:
            if threads:
                torch.set_num_threads(threads)  # this process is rank 0: its share of the cores
            await asyncio.to_thread(processes.join_group)
            await hooks.on_event("info", f"Training on {n} processes ({rendezvous.backend}); rank 0 reports, each "
                                         "rank trains a share of every step.",
                                 {"training_processes": n, "backend": rendezvous.backend})
            yield processes.group
        finally:
            await asyncio.to_thread(processes.stop)
            torch.set_num_threads(cores)

    async def _process_count(self, loaded: Any, hooks: ControlHooks) -> int:
        """The job's `x_open_model.training_processes`, within the worker's limit and its GPUs."""
        import torch

        limit = self.settings.training_processes
        asked = method_block_of(self.job).x_open_model.training_processes or limit
        on_gpu = loaded.device.type == "cuda"
        gpus = torch.cuda.device_count() if on_gpu else None
        n = min(asked, limit, gpus or limit)
        if n < asked:
            await hooks.on_event("warn", f"The job asks for {asked} training processes; this worker runs at most "
                                         f"{n} (AGENT_RFT_TRAINING_PROCESSES={limit}"
                                         f"{f', {gpus} GPUs' if on_gpu else ''}).",
                                 {"asked": asked, "training_processes": n})
        return n

    async def load_start(self, dtype: str, training_mode: str, hooks: ControlHooks) -> Any:
        """The weights training starts from: the base model, or the fine-tuned model the job names."""
        from workers.models.lora import load_start

        start = self.job.start_from
        loaded, how = load_start(self.job.model, start, dtype=dtype, training_mode=training_mode)
        if start is not None:
            await hooks.on_event("info", f"Starting from {self.job.model} ({start.base_model}): {how}.",
                                 {"start_from": start.model_dump()})
        return loaded



def method_block_of(job: Any) -> Any:
    """The claimed job's method block (`job.method.reinforcement`, `.supervised`, `.dpo`)."""
    return getattr(job.method, job.method.type)


class ControlHooks:
    """The trainer's reporting channel: every call becomes an idempotent push."""

    def __init__(self, run: JobRun, resolved: dict[str, Any] | None) -> None:
        self.run, self.client, self.job_id, self.lease_id = run, run.client, run.job_id, run.lease_id
        self.resolved = resolved
        self._events = 0

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from workers.training.training_run import RunInterrupted

        try:
            return await asyncio.to_thread(fn, self.job_id, self.lease_id, *args, **kwargs)
        except (ControlPlaneUnreachable, LeaseLost) as exc:  # not the training's fault: see JobRun._give_back
            raise RunInterrupted(str(exc)) from exc

    async def on_step(self, step: int, metrics: dict[str, Any], train_records: list[dict[str, Any]]) -> None:
        if train_records:  # a supervised step has none
            await self._call(self.client.push_rollouts, step, "train", train_records)
        await self._call(self.client.push_step, step, metrics)
        if self.run.wandb is not None:
            self.run.wandb.log_step(step, metrics, self.resolved)
        record_step(self.job_id, metrics, rollouts=len(train_records))

    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict[str, Any]]) -> None:
        await self._call(self.client.push_rollouts, step, "valid", valid_records)

    async def on_checkpoint(self, step: int, path: Path, metrics: dict[str, Any]) -> list[str]:
        return await self._call(self.client.push_checkpoint, step, str(path), metrics)

    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None:
        await self._call(self.client.push_state, completed_steps=completed_steps, resume_state=str(state_path),
                         resolved_hyperparameters=self.resolved, trained_tokens=trained_tokens)

    async def control(self) -> str:
        from workers.training.training_run import RunInterrupted

        action = await asyncio.to_thread(self.run.heartbeat.beat)
        if action == "unreachable":  # do not train a step that could not be reported
            raise RunInterrupted("the control plane did not answer the heartbeat for a lease's time")
        return "cancel" if action == "lost" else action

    async def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        # The key makes a retried push a no-op; the claim's lease makes keys of two runs distinct.
        self._events += 1
        key = f"{self.lease_id}:{self._events}"
        await self._call(self.client.push_event, key, level, message, data)


