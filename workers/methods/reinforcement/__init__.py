"""Reinforcement fine-tuning of a claimed job (`method.type = "reinforcement"`, docs/training.md):
the variance diagnostic where the job asks for one, the sampler (the in-process engine or a vLLM
fleet), the job's other training processes, and the trainer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.control_client import NotClaimable, worker_id
from workers.control_client import GIVEN_BACK
from workers.diagnostics import DiagnosticRun, claim_with_patience
if TYPE_CHECKING:
    from workers.tasks import ControlHooks, JobRun


async def train(run: JobRun) -> Any:
    from agent_rft.graders.core import GraderContext
    from workers.models.loading import load_model
    from workers.methods.reinforcement.hyperparameters import resolve_hyperparameters
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.trainer import Trainer
    from workers.training.training_run import TrainingOutcome

    job, reinforcement = run.job, run.job.method.reinforcement
    train_rows, valid_rows = run.rows(job.training_file), run.rows(job.validation_file)
    hooks = run.hooks(None)
    loaded = None
    dtype = reinforcement.x_open_model.dtype
    if reinforcement.x_open_model.diagnostic:
        loaded = await run.load_start(dtype, reinforcement.x_open_model.training_mode, hooks)  # once
        diagnosed = await JobDiagnostic(run, hooks).run(loaded, train_rows)
        if isinstance(diagnosed, TrainingOutcome):
            return diagnosed
        train_rows = diagnosed
    config, resolved = resolve_hyperparameters(reinforcement, n_train=len(train_rows), n_valid=len(valid_rows),
                                               seed=job.seed)
    config.engine.kv_cache_mb = run.settings.kv_cache_mb  # the worker's memory, not the job's choice
    hooks.resolved = resolved
    await hooks.on_event("info", f"Training {job.model} on {len(train_rows)} rows; "
                                 f"hyperparameters: {json.dumps(resolved, sort_keys=True)}", {"hyperparameters": resolved})
    loaded = loaded or await run.load_start(dtype, config.training_mode, hooks)
    sampler = await sampler_for(run, config, hooks)
    if isinstance(sampler, TrainingOutcome):
        return sampler
    args = _trainer_args(run, config, train_rows, valid_rows)
    try:
        async with ToolClient(reinforcement.tools, allowlist=run.settings.outbound_allowlist) as tools, \
                run.training_processes(loaded, config.training_mode, args, hooks,
                                       allowlist=run.settings.outbound_allowlist) as group:
            grader_ctx = GraderContext.from_settings(run.settings, load_judge_model=load_model)
            trainer = Trainer(loaded=loaded, grader_ctx=grader_ctx, tool_client=tools, hooks=hooks, sampler=sampler,
                              group=group, **args)
            return await trainer.run()
    finally:
        if sampler is not None:
            await sampler.release()


def _trainer_args(run: JobRun, config: Any, train_rows: list[dict[str, Any]],
                  valid_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The trainer's arguments every training process builds it with."""
    reinforcement = run.job.method.reinforcement
    return {"config": config, "train_rows": train_rows, "valid_rows": valid_rows, "grader": reinforcement.grader,
            "job_tools": reinforcement.tools, "work_dir": run.work_dir,
            "resume_state": Path(run.job.resume_state) if run.job.resume_state else None}


async def follow(group: Any, loaded: Any, args: dict[str, Any]) -> None:
    """A follower's trainer (workers/training/distributed/follower.py): rank 0's, sampling with the job's
    tools; no grader (rank 0 grades)."""
    from workers.training.distributed.follower import serve
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.trainer import Trainer

    allowlist = args.pop("allowlist")
    async with ToolClient(args["job_tools"], allowlist=allowlist) as tools:
        await serve(group, Trainer(loaded=loaded, grader_ctx=None, tool_client=tools, hooks=None, group=group, **args))

async def sampler_for(run: JobRun, config: Any, hooks: ControlHooks) -> Any:
    """The vLLM fleet where the job asks for it (x_open_model.sampler) or "auto" finds one for a
    LoRA job; None for the in-process engine; the failed TrainingOutcome when none answers."""
    from workers.training.training_run import TrainingOutcome
    from workers.engine.vllm_sampler import VLLMSampler, VLLMUnavailable

    choice, urls = run.job.method.reinforcement.x_open_model.sampler, run.settings.vllm_urls
    if choice == "engine" or (choice == "auto" and (not urls or config.training_mode != "lora")):
        return None
    try:
        if not urls:
            raise VLLMUnavailable("the job asks for sampler 'vllm' but this worker has no vLLM servers "
                                  "(AGENT_RFT_VLLM_URLS)")
        base = run.job.start_from.base_model if run.job.start_from else run.job.model  # what vLLM serves
        sampler = VLLMSampler.from_settings(run.settings, model=base, config=config.engine,
                                            adapter_prefix=run.job_id)
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
        from workers.training.training_run import RunInterrupted

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
        from workers.training.training_run import TrainingOutcome

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
        from workers.training.training_run import TrainingOutcome

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
