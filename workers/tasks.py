"""Celery tasks. `run_job` turns a queued job into a trained, checkpointed model, reporting
every step to the control plane over its internal API."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from app.diagnostics.worker_schemas import DiagnosticClaimResponse
from app.jobs.worker_schemas import ClaimResponse
from workers.celery_app import RUN_DIAGNOSTIC_TASK, RUN_JOB_TASK, celery_app
from workers.control_client import (
    ControlPlaneClient,
    ControlPlaneUnreachable,
    Heartbeat,
    LeaseHeld,
    LeaseLost,
    NotClaimable,
    worker_id,
)
from workers.diagnostics import GIVEN_BACK, DiagnosticRun, claim_with_patience
from workers.metrics import record_step  # also starts the metrics server with the worker
from workers.integrations.wandb_run import wandb_run

log = logging.getLogger(__name__)
# One line per internal-API call would drown the worker's log; failures are logged by the client.
logging.getLogger("httpx").setLevel(logging.WARNING)
LEASE_RETRY_COUNTDOWN_S = 10
Claimed = TypeVar("Claimed", ClaimResponse, DiagnosticClaimResponse)


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


class JobRun:
    """One claimed job on this worker: heartbeat, data, model, trainer, final report."""

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
        from workers.rl.training_run import RunInterrupted
        from workers.spans import configure_from_environment

        configure_from_environment()  # OpenTelemetry spans, where OTEL_EXPORTER_OTLP_* says where to send them
        self.heartbeat.start()
        try:
            outcome = asyncio.run(self._train())
        except (RunInterrupted, ControlPlaneUnreachable, LeaseLost) as exc:
            return self._give_back(exc)
        except Exception as exc:  # noqa: BLE001 - anything that escapes the trainer fails the job, with the reason
            log.exception("job %s failed", self.job_id)
            error = {"code": "worker_error", "message": f"{type(exc).__name__}: {exc}"[:2000], "param": None}
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

    def _rows(self, file_id: str | None) -> list[dict[str, Any]]:
        return self.client.file_rows(file_id) if file_id else []

    async def _train(self) -> Any:
        if self.job.method.type == "supervised":
            return await self._train_supervised()
        return await self._train_reinforcement()

    async def _train_supervised(self) -> Any:
        from workers.sft.hyperparameters import resolve_supervised
        from workers.sft.trainer import SupervisedTrainer

        job, supervised = self.job, self.job.method.supervised
        train_rows, valid_rows = self._rows(job.training_file), self._rows(job.validation_file)
        config, resolved = resolve_supervised(supervised, n_train=len(train_rows), seed=job.seed)
        hooks = ControlHooks(self, resolved)
        await hooks.on_event("info", f"Training {job.model} on {len(train_rows)} rows (supervised); "
                                     f"hyperparameters: {json.dumps(resolved, sort_keys=True)}", {"hyperparameters": resolved})
        loaded = await self._load_start(supervised.x_open_model.dtype, config.training_mode, hooks)
        trainer = SupervisedTrainer(loaded=loaded, config=config, train_rows=train_rows, valid_rows=valid_rows,
                                    work_dir=self.work_dir, hooks=hooks,
                                    resume_state=Path(job.resume_state) if job.resume_state else None)
        return await trainer.run()

    async def _load_start(self, dtype: str, training_mode: str, hooks: ControlHooks) -> Any:
        """The weights training starts from: the base model, or the fine-tuned model the job names."""
        from workers.rl.models import load_start

        start = self.job.start_from
        loaded, how = load_start(self.job.model, start, dtype=dtype, training_mode=training_mode)
        if start is not None:
            await hooks.on_event("info", f"Starting from {self.job.model} ({start.base_model}): {how}.",
                                 {"start_from": start.model_dump()})
        return loaded

    async def _train_reinforcement(self) -> Any:
        import torch

        from app.graders.service import grader_context
        from workers.rl.hyperparameters import resolve_hyperparameters
        from workers.rl.tools_client import ToolClient
        from workers.rl.trainer import Trainer
        from workers.rl.training_run import TrainingOutcome

        job, reinforcement = self.job, self.job.method.reinforcement
        train_rows, valid_rows = self._rows(job.training_file), self._rows(job.validation_file)
        hooks = ControlHooks(self, None)
        loaded = None
        dtype = reinforcement.x_open_model.dtype
        if reinforcement.x_open_model.diagnostic:
            loaded = await self._load_start(dtype, reinforcement.x_open_model.training_mode, hooks)  # once
            diagnosed = await JobDiagnostic(self, hooks).run(loaded, train_rows)
            if isinstance(diagnosed, TrainingOutcome):
                return diagnosed
            train_rows = diagnosed
        config, resolved = resolve_hyperparameters(reinforcement, n_train=len(train_rows), n_valid=len(valid_rows),
                                                   seed=job.seed)
        config.engine.kv_cache_mb = self.settings.kv_cache_mb  # the worker's memory, not the job's choice
        hooks.resolved = resolved
        await hooks.on_event("info", f"Training {job.model} on {len(train_rows)} rows; "
                                     f"hyperparameters: {json.dumps(resolved, sort_keys=True)}", {"hyperparameters": resolved})
        loaded = loaded or await self._load_start(dtype, config.training_mode, hooks)
        sampler = await self._sampler(config, hooks)
        if isinstance(sampler, TrainingOutcome):
            return sampler
        threads = torch.get_num_threads()  # rank 0 of several processes takes its share of the cores
        processes = None
        try:
            async with ToolClient(reinforcement.tools, allowlist=self.settings.outbound_allowlist) as tools:
                processes = await self._training_processes(config, loaded, train_rows, valid_rows, hooks)
                trainer = Trainer(
                    loaded=loaded, config=config, train_rows=train_rows, valid_rows=valid_rows,
                    grader=reinforcement.grader, grader_ctx=grader_context(self.settings), tool_client=tools,
                    job_tools=reinforcement.tools, work_dir=self.work_dir, hooks=hooks,
                    resume_state=Path(job.resume_state) if job.resume_state else None, sampler=sampler,
                    group=processes.group if processes else None,
                )
                return await trainer.run()
        finally:
            if processes is not None:
                await asyncio.to_thread(processes.stop)
            torch.set_num_threads(threads)
            if sampler is not None:
                await sampler.release()

    async def _training_processes(self, config: Any, loaded: Any, train_rows: list[dict[str, Any]],
                                  valid_rows: list[dict[str, Any]], hooks: ControlHooks) -> Any:
        """The job's other training processes, started and joined (docs/scaling.md); None when it
        trains in this process alone."""
        import torch

        from workers.distributed.group import Rendezvous
        from workers.distributed.launch import TrainingProcesses, backend_for, free_port
        from workers.rl.follower import FollowerJob, follow

        reinforcement, limit = self.job.method.reinforcement, self.settings.training_processes
        asked = reinforcement.x_open_model.training_processes or limit
        on_gpu = loaded.device.type == "cuda"
        gpus = torch.cuda.device_count() if on_gpu else None
        n = min(asked, limit, gpus or limit)
        if n < asked:
            await hooks.on_event("warn", f"The job asks for {asked} training processes; this worker runs at most "
                                         f"{n} (AGENT_RFT_TRAINING_PROCESSES={limit}"
                                         f"{f', {gpus} GPUs' if on_gpu else ''}).",
                                 {"asked": asked, "training_processes": n})
        if n == 1:
            return None
        threads = None if on_gpu else max(1, len(os.sched_getaffinity(0)) // n)
        if threads:
            torch.set_num_threads(threads)  # this process is rank 0: its share of the cores
        follower = FollowerJob(self.job.model, self.job.start_from, reinforcement.x_open_model.dtype, threads, config,
                               train_rows, valid_rows, reinforcement.grader, reinforcement.tools,
                               self.settings.outbound_allowlist, str(self.work_dir), self.job.resume_state)
        rendezvous = Rendezvous(free_port(), n, self.settings.training_rank_timeout_s, backend_for(loaded.device.type))
        processes = TrainingProcesses(rendezvous, follow, follower, self.work_dir)
        try:
            await asyncio.to_thread(processes.join_group)
        except BaseException:
            await asyncio.to_thread(processes.stop)
            raise
        await hooks.on_event("info", f"Training on {n} processes ({rendezvous.backend}); rank 0 reports, each rank "
                                     "samples and trains a share of every step.",
                             {"training_processes": n, "backend": rendezvous.backend})
        return processes

    async def _sampler(self, config: Any, hooks: ControlHooks) -> Any:
        """The vLLM fleet where the job asks for it (x_open_model.sampler) or "auto" finds one for a
        LoRA job; None for the in-process engine; the failed TrainingOutcome when none answers."""
        from workers.rl.training_run import TrainingOutcome
        from workers.rl.vllm_sampler import VLLMSampler, VLLMUnavailable

        choice, urls = self.job.method.reinforcement.x_open_model.sampler, self.settings.vllm_urls
        if choice == "engine" or (choice == "auto" and (not urls or config.training_mode != "lora")):
            return None
        try:
            if not urls:
                raise VLLMUnavailable("the job asks for sampler 'vllm' but this worker has no vLLM servers "
                                      "(AGENT_RFT_VLLM_URLS)")
            base = self.job.start_from.base_model if self.job.start_from else self.job.model  # what vLLM serves
            sampler = VLLMSampler.from_settings(self.settings, model=base, config=config.engine,
                                                adapter_prefix=self.job_id)
            live = await sampler.check()
        except VLLMUnavailable as exc:
            message = f"Rollouts cannot be sampled on vLLM: {exc}"
            await hooks.on_event("error", message, {"vllm_urls": urls})
            return TrainingOutcome("failed", 0, 0, 0, {"code": "sampler_unavailable", "message": message,
                                                       "param": "method.reinforcement.x_open_model.sampler"}, None)
        await hooks.on_event("info", f"Rollouts are sampled on vLLM: {', '.join(live)} "
                                     f"(of {len(urls)} configured).", {"vllm_urls": urls, "live": live})
        return sampler


class JobDiagnostic:
    """`x_open_model.diagnostic`: the job's variance diagnostic, run by this worker before
    training with the model it trains; optionally the zero-signal samples are dropped."""

    def __init__(self, run: JobRun, hooks: ControlHooks) -> None:
        self.run_, self.hooks = run, hooks
        self.options = run.job.method.reinforcement.x_open_model.diagnostic

    async def run(self, loaded: Any, rows: list[dict[str, Any]]) -> Any:
        """The rows to train on, or the TrainingOutcome that ends the job here."""
        from workers.rl.training_run import RunInterrupted

        run = self.run_
        found = await asyncio.to_thread(run.client.job_diagnostic, run.job_id, run.lease_id)
        if found.status != "succeeded":
            status = await self._run_it(found.id, loaded, rows)
            if status == GIVEN_BACK:
                raise RunInterrupted(f"the control plane could not be reached during diagnostic {found.id}")
            if status != "succeeded":
                return await self._stopped(found.id, status)
        diagnostic = await asyncio.to_thread(run.client.diagnostic, found.id)
        verdict = diagnostic.verdict or {}
        await self.hooks.on_event("warn" if verdict.get("level") in ("warning", "error") else "info",
                                  f"Variance diagnostic {found.id}: {verdict.get('message', 'no verdict')}",
                                  {"diagnostic_id": found.id, "summary": diagnostic.summary, "verdict": verdict})
        if not self.options.drop_zero_signal:
            return rows
        return await self._drop_zero_signal(found.id, diagnostic, rows)

    async def _run_it(self, diagnostic_id: str, loaded: Any, rows: list[dict[str, Any]]) -> str:
        run = self.run_
        try:  # the job's client serves its diagnostic too: each call names the lease it holds
            claim = await asyncio.to_thread(claim_with_patience, run.client, diagnostic_id, worker_id(),
                                            wait_s=2.0 * run.settings.lease_seconds)
            await self.hooks.on_event("info", f"Variance diagnostic {diagnostic_id} started: "
                                              f"{self.options.runs_per_sample} runs per sample before training.",
                                      {"diagnostic_id": diagnostic_id})
            return await DiagnosticRun(run.client, claim, run.settings, outer=run.heartbeat).run(loaded=loaded,
                                                                                               rows=rows)
        except NotClaimable:  # it ended meanwhile (e.g. it succeeded just before this worker took the job over)
            return (await asyncio.to_thread(run.client.diagnostic, diagnostic_id)).status

    async def _stopped(self, diagnostic_id: str, status: str) -> Any:
        """The job's outcome when its diagnostic did not succeed: the user's pause or cancel, or a failure."""
        from workers.rl.training_run import TrainingOutcome

        action = await asyncio.to_thread(self.run_.heartbeat.beat)
        if action in ("pause", "cancel", "lost"):
            return TrainingOutcome("paused" if action == "pause" else "cancelled", 0, 0, 0, None, None)
        error = {"code": "diagnostic_failed", "param": None,
                 "message": f"The variance diagnostic {diagnostic_id} run before training ended '{status}'; "
                            f"see GET /v1/fine_tuning/alpha/diagnostics/{diagnostic_id}."}
        return TrainingOutcome("failed", 0, 0, 0, error, None)

    async def _drop_zero_signal(self, diagnostic_id: str, diagnostic: Any,
                                rows: list[dict[str, Any]]) -> Any:
        from app.diagnostics.summary import zero_signal_samples
        from workers.rl.training_run import TrainingOutcome

        zero = set(zero_signal_samples(diagnostic.samples or []))
        kept = [row for index, row in enumerate(rows) if index not in zero]
        data = {"diagnostic_id": diagnostic_id, "dropped": len(zero), "kept": len(kept), "rows": len(rows)}
        if not kept:
            message = (f"Every training row is zero-signal in diagnostic {diagnostic_id} (no sample got mixed "
                       "scores), so drop_zero_signal leaves nothing to train on.")
            await self.hooks.on_event("error", message, data)
            return TrainingOutcome("failed", 0, 0, 0, {"code": "no_signal", "message": message, "param": None}, None)
        await self.hooks.on_event("info", f"Dropped {len(zero)} zero-signal samples of {len(rows)} "
                                          f"(diagnostic {diagnostic_id}); training on {len(kept)} rows.", data)
        return kept


class ControlHooks:
    """The trainer's reporting channel: every call becomes an idempotent push."""

    def __init__(self, run: JobRun, resolved: dict[str, Any] | None) -> None:
        self.run, self.client, self.job_id, self.lease_id = run, run.client, run.job_id, run.lease_id
        self.resolved = resolved
        self._events = 0

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from workers.rl.training_run import RunInterrupted

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
        from workers.rl.training_run import RunInterrupted

        action = await asyncio.to_thread(self.run.heartbeat.beat)
        if action == "unreachable":  # do not train a step that could not be reported
            raise RunInterrupted("the control plane did not answer the heartbeat for a lease's time")
        return "cancel" if action == "lost" else action

    async def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        # The key makes a retried push a no-op; the claim's lease makes keys of two runs distinct.
        self._events += 1
        key = f"{self.lease_id}:{self._events}"
        await self._call(self.client.push_event, key, level, message, data)


