"""A variance diagnostic on a worker: what the `run_diagnostic` task runs, and what a job with
`x_open_model.diagnostic` runs before training (workers/tasks.py). Claim under a lease,
heartbeat, the rows, the model, the rollouts (workers/methods/reinforcement/diagnostic.py), pushes, finish.

A job's worker holds the job's lease and its diagnostic's at the same time, on one client: every
call names its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from app.diagnostics.worker_schemas import DiagnosticClaimResponse
from workers.control_client import (
    ControlPlaneClient, ControlPlaneUnreachable, Heartbeat, LeaseHeld, run_under_lease)

log = logging.getLogger(__name__)


class DiagnosticRun:
    """One claimed diagnostic. `outer` is the heartbeat of the job that runs it, if any: when the
    job is paused, cancelled or lost, the diagnostic stops at its next chunk."""

    def __init__(self, client: ControlPlaneClient, claim: DiagnosticClaimResponse, settings: Any, *,
                 outer: Heartbeat | None = None) -> None:
        self.client, self.settings, self.outer = client, settings, outer
        self.spec, self.lease_id = claim.diagnostic, claim.lease_id
        self.id = self.spec.id
        self.heartbeat = Heartbeat(client, self.id, self.lease_id, interval_s=max(1.0, settings.lease_seconds / 4),
                                   call=client.diagnostic_heartbeat)

    async def run(self, *, loaded: Any = None, rows: list[dict[str, Any]] | None = None) -> str:
        """succeeded, failed, cancelled, lost (another worker has it now) or given_back (the control
        plane could not be reached: no end is reported). Never raises."""
        return await run_under_lease(
            f"diagnostic {self.id}", self.heartbeat, lambda: self._run(loaded, rows),
            lambda status, error: self.client.finish_diagnostic(self.id, self.lease_id, status, error=error))

    async def _run(self, loaded: Any, rows: list[dict[str, Any]] | None) -> str:
        from agent_rft.graders.core import GraderContext
        from workers.training.data import job_tool_schemas, prompts_from_rows
        from workers.methods.reinforcement.diagnostic import load_basis, run_diagnostic, select_samples
        from workers.methods.reinforcement.hyperparameters import resolve_hyperparameters
        from workers.models.loading import load_model
        from workers.engine.prompting import ChatFormatter
        from workers.engine.rollout import RolloutEngine
        from workers.engine.tools_client import ToolClient, ToolClientOptions

        spec, reinforcement = self.spec, self.spec.method.reinforcement
        if rows is None:
            rows = await asyncio.to_thread(self.client.file_rows, spec.training_file)
        prompts = prompts_from_rows(rows, job_tool_schemas(reinforcement.tools), source="training")
        chosen = select_samples(len(prompts), spec.max_samples, spec.seed)
        # The engine settings training would use: the diagnostic measures the same policy.
        config, _ = resolve_hyperparameters(reinforcement, n_train=len(rows), n_valid=0, seed=spec.seed)
        options = ToolClientOptions()
        basis = load_basis(reinforcement, n_train=len(rows), seed=spec.seed,
                           tool_max_concurrency=options.max_concurrency, tools=reinforcement.tools)
        await asyncio.to_thread(self.client.push_diagnostic_rollouts, self.id, self.lease_id, [],
                                samples_total=len(chosen), load_basis=basis)
        if loaded is None:
            loaded = await asyncio.to_thread(load_model, spec.model, dtype=reinforcement.x_open_model.dtype)
        async with ToolClient(reinforcement.tools, allowlist=self.settings.outbound_allowlist, options=options,
                              non_read_only=spec.non_read_only_tools) as tool_client:
            engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), tool_client,
                                   config.engine)
            outcome = await run_diagnostic(
                engine=engine, grader=reinforcement.grader, grader_ctx=GraderContext.from_settings(
                    self.settings, load_judge_model=load_model),
                prompts=prompts, sample_indexes=chosen, runs_per_sample=spec.runs_per_sample, seed=spec.seed,
                hooks=self, done=frozenset(spec.done_samples))
        return outcome.status

    # -- hooks of workers/methods/reinforcement/diagnostic.run_diagnostic --------------------------------------------

    async def on_rollouts(self, records: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self.client.push_diagnostic_rollouts, self.id, self.lease_id, records)

    async def control(self) -> str:
        go_on = await asyncio.to_thread(self.heartbeat.go_on)
        if self.outer is not None and self.outer.action == "unreachable":
            raise ControlPlaneUnreachable(503, "control_plane_unreachable", "no heartbeat answer for a lease's time")
        return "continue" if go_on and (self.outer is None or self.outer.action == "continue") else "cancel"


def claim_with_patience(client: ControlPlaneClient, diagnostic_id: str, worker_id: str, *,
                        wait_s: float) -> DiagnosticClaimResponse:
    """Claim a job's diagnostic; while the previous worker's lease is still live (it died moments
    ago), wait for it to expire rather than give up."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.claim_diagnostic(diagnostic_id, worker_id)
        except LeaseHeld:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
