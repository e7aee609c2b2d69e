"""Celery tasks. `run_job` turns a queued job into a trained, checkpointed model, reporting
every step to the control plane over its internal API."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from workers.celery_app import RUN_JOB_TASK, celery_app
from workers.control_client import Claim, ControlPlaneClient, Heartbeat, LeaseHeld, NotClaimable

log = logging.getLogger(__name__)
# One line per internal-API call would drown the worker's log; failures are logged by the client.
logging.getLogger("httpx").setLevel(logging.WARNING)
LEASE_RETRY_COUNTDOWN_S = 10


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@celery_app.task(name=RUN_JOB_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=360)
def run_job(self, job_id: str) -> dict[str, Any]:  # noqa: ANN001
    from app.core.config import get_settings

    settings = get_settings()
    client = ControlPlaneClient(settings.api_url, settings.worker_token.get_secret_value())
    try:
        try:
            claim = client.claim(job_id, worker_id())
        except LeaseHeld as exc:  # another worker still holds it (e.g. saving state after a pause)
            raise self.retry(countdown=LEASE_RETRY_COUNTDOWN_S, exc=exc) from exc
        except NotClaimable as exc:
            log.info("job %s not claimable: %s", job_id, exc.message)
            return {"job_id": job_id, "status": "skipped", "reason": exc.message}
        return JobRun(client, claim, settings).run()
    finally:
        client.close()


class JobRun:
    """One claimed job on this worker: heartbeat, data, model, trainer, final report."""

    def __init__(self, client: ControlPlaneClient, claim: Claim, settings: Any) -> None:
        self.client, self.claim, self.settings = client, claim, settings
        self.job = claim.job
        self.job_id = self.job["id"]
        self.heartbeat = Heartbeat(client, self.job_id, interval_s=max(1.0, settings.lease_seconds / 4))
        self.work_dir = Path(settings.resolved_checkpoint_dir) / self.job_id

    def run(self) -> dict[str, Any]:
        self.heartbeat.start()
        try:
            outcome = asyncio.run(self._train())
        except Exception as exc:  # noqa: BLE001 - anything that escapes the trainer fails the job, with the reason
            log.exception("job %s failed", self.job_id)
            error = {"code": "worker_error", "message": f"{type(exc).__name__}: {exc}"[:2000], "param": None}
            self._finish("failed", error=error)
            return {"job_id": self.job_id, "status": "failed"}
        finally:
            self.heartbeat.stop()
        if self.heartbeat.action != "lost":
            self._finish(outcome.status, error=outcome.error, trained_tokens=outcome.trained_tokens)
        return {"job_id": self.job_id, "status": outcome.status, "steps": outcome.completed_steps}

    def _finish(self, status: str, **kwargs: Any) -> None:
        try:
            self.client.finish(self.job_id, status, **kwargs)
        except Exception:  # noqa: BLE001 - the watchdog re-queues a job whose worker cannot report
            log.exception("could not report the end of job %s", self.job_id)

    def _rows(self, file_id: str | None) -> list[dict[str, Any]]:
        if not file_id:
            return []
        text = self.client.file_content(file_id).decode("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    async def _train(self) -> Any:
        from pydantic import TypeAdapter

        from app.graders.schemas import Grader
        from app.graders.service import grader_context
        from workers.rl.models import load_model
        from workers.rl.tools_client import ToolClient
        from workers.rl.trainer import Trainer, resolve_hyperparameters

        reinforcement = self.job["method"]["reinforcement"]
        train_rows, valid_rows = self._rows(self.job["training_file"]), self._rows(self.job.get("validation_file"))
        config, resolved = resolve_hyperparameters(reinforcement, n_train=len(train_rows), n_valid=len(valid_rows),
                                                   seed=self.job["seed"])
        hooks = ControlHooks(self, resolved)
        await hooks.on_event("info", f"Training {self.job['model']} on {len(train_rows)} rows; "
                                     f"hyperparameters: {json.dumps(resolved, sort_keys=True)}", {"hyperparameters": resolved})
        loaded = load_model(self.job["model"])
        resume = self.job.get("resume_state")
        async with ToolClient(reinforcement.get("tools", []), allowlist=self.settings.outbound_allowlist) as tools:
            trainer = Trainer(
                loaded=loaded, config=config, train_rows=train_rows, valid_rows=valid_rows,
                grader=TypeAdapter(Grader).validate_python(reinforcement["grader"]),
                grader_ctx=grader_context(self.settings), tool_client=tools, job_tools=reinforcement.get("tools", []),
                work_dir=self.work_dir, hooks=hooks, resume_state=Path(resume) if resume else None,
            )
            return await trainer.run()


class ControlHooks:
    """The trainer's reporting channel: every call becomes an idempotent push."""

    def __init__(self, run: JobRun, resolved: dict[str, Any]) -> None:
        self.run, self.client, self.job_id = run, run.client, run.job_id
        self.resolved = resolved
        self._events = 0

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, self.job_id, *args, **kwargs)

    async def on_step(self, step: int, metrics: dict[str, Any], train_records: list[dict[str, Any]]) -> None:
        await self._call(self.client.push_rollouts, step, "train", train_records)
        await self._call(self.client.push_step, step, metrics)

    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict[str, Any]]) -> None:
        await self._call(self.client.push_rollouts, step, "valid", valid_records)

    async def on_checkpoint(self, step: int, path: Path, metrics: dict[str, Any]) -> list[str]:
        return await self._call(self.client.push_checkpoint, step, str(path), metrics)

    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None:
        await self._call(self.client.push_state, completed_steps=completed_steps, resume_state=str(state_path),
                         resolved_hyperparameters=self.resolved, trained_tokens=trained_tokens)

    async def control(self) -> str:
        action = await asyncio.to_thread(self.run.heartbeat.beat)
        return "cancel" if action == "lost" else action

    async def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        # The key makes a retried push a no-op; the claim's lease makes keys of two runs distinct.
        self._events += 1
        key = f"{self.run.claim.lease_id}:{self._events}"
        await self._call(self.client.push_event, key, level, message, data)


