"""The GRPO-family trainer (docs/training.md): sample groups of multi-turn rollouts against the
customer's tools, grade them, and update the policy with group-relative advantages. The loop
reads top to bottom, one step at a time (`Trainer._train_step`):

1. the batch (`_sample_batch`): the next `batch_size` rows of the data stream
   (workers/training/data.py), `group_size` rollouts per row in ONE run of the rollout engine
   (workers/engine/rollout.py), each graded unless it ended in a tool failure
   (workers/engine/grading.py); with `refill_zero_spread`, more rows until `batch_size` groups have a
   reward spread. With `max_staleness` 1 this step's batch was sampled while the previous step
   updated (lookahead.py);
2. a step where the tool-failure or grader-failure rate exceeds its threshold fails the job;
3. advantages per group; groups without reward spread are skipped;
4. with `max_staleness` 1, the next step's batch starts sampling now, on the policy before this update;
5. update: one optimizer step of the clipped objective (workers/methods/reinforcement/update.py);
6. eval every `eval_interval` steps and at the end, on a fixed set of validation rows;
7. the step's metrics (step_report.py), returned with its rollouts: the lifecycle
   (workers/training/training_run.py) reports them, checkpoints an eval step and saves the state.

The configuration and its "auto" rules are workers/methods/reinforcement/hyperparameters.py; docs/training.md
describes every option, auto rule and failure mode.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_rft.graders.core import GraderContext
from workers.training.distributed.group import TrainingGroup, shares
from workers.training.data import fixed_subset, job_tool_schemas, prompts_from_rows, rollout_seed, spec_for, take_batch
from workers.engine.grading import GradedRollout, grade_rollouts, load_grader, mean_or_none, sub_reward_means
from workers.methods.reinforcement.hyperparameters import REFILL_LIMIT, TrainingConfig
from workers.training.data import total_steps_for
from workers.models.registry import LoadedModel
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import RolloutEngine
from workers.engine.sampler import Sampler
from workers.methods.reinforcement.lookahead import LAGGED_POLICY, LaggedPolicy, Lookahead
from workers.methods.reinforcement.step_report import GraderLoad, SamplingCost, StepClock, step_metrics
from workers.training.training_run import StepFailure, StepResult, TrainingHooks, TrainingRun
from workers.methods.reinforcement.update import (
    LossSettings,
    UpdateStats,
    groups_with_spread,
    policy_update,
    train_sequences,
)
from workers.training.sequences import Collated, TrainSequence, token_logprobs
from workers.training.training_state import DataPosition, load_extra_tensors

log = logging.getLogger(__name__)

POLICY_DIR = "policy"  # the current LoRA adapter, for a sampler in another process


@dataclass
class SampledBatch:
    """A step's rollouts, graded: what its update trains on."""

    graded: list[GradedRollout]
    n_groups: int  # prompts drawn (more than batch_size when refill_zero_spread drew again)
    next_position: DataPosition  # where the data stream continues after them
    cost: SamplingCost
    graders: dict[str, Any]  # the graders' backpressure while grading them
    seconds: dict[str, float]  # {"sampling", "grading"}: their own time
    ahead: bool = False  # sampled while the previous step updated


class Trainer(TrainingRun):
    def __init__(self, *, loaded: LoadedModel, config: TrainingConfig, train_rows: list[dict], valid_rows: list[dict],
                 grader: Any, grader_ctx: GraderContext, tool_client: Any, job_tools: list[dict], work_dir: Path,
                 hooks: TrainingHooks, resume_state: Path | None = None, sampler: Sampler | None = None,
                 group: TrainingGroup | None = None) -> None:
        super().__init__(loaded=loaded, config=config, work_dir=work_dir, hooks=hooks, resume_state=resume_state,
                         total_steps=total_steps_for(len(train_rows), config.batch_size, config.n_epochs), group=group)
        self.train_rows, self.valid_rows = train_rows, valid_rows
        self.grader, self.grader_ctx, self.tool_client = grader, grader_ctx, tool_client
        self.job_tools = job_tools
        self.sampler = sampler  # None: the in-process engine on the model being trained
        self.failovers_reported = 0
        self.continues_adapter = hasattr(loaded.model, "peft_config")  # started from a fine-tuned LoRA model
        self.lookahead: Lookahead | None = None  # max_staleness 1: the next step's batch, sampled in the background
        self.lagged: LaggedPolicy | None = None  # what the in-process engine samples ahead on
        self.ahead_engine: RolloutEngine | None = None

    async def _before_steps(self) -> None:
        # The sampler starts from the restored policy, or the fine-tuned adapter the job continues.
        if self.progress.step > 0 or self.continues_adapter:
            await self._publish_policy(self.progress.step)
        if self.lagged is not None:
            await self._restore_lagged_policy()

    async def _restore_lagged_policy(self) -> None:
        """The in-process copy sampled ahead on: the policy one version behind the restored one,
        as saved with the state, so that the next step samples what it would have uninterrupted."""
        saved = load_extra_tensors(self.resume_state, LAGGED_POLICY) if self.resume_state else None
        if saved is not None and self.progress.step > 0:
            await asyncio.to_thread(self.lagged.load, saved)
            await self.ahead_engine.sampler.publish_policy(self.progress.step - 1, None)
        else:
            await asyncio.to_thread(self.lagged.refresh, self.model)
            await self.ahead_engine.sampler.publish_policy(self.progress.step, None)

    async def _after_steps(self) -> None:
        if self.lookahead is not None:
            await self.lookahead.stop()

    def _extra_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {LAGGED_POLICY: self.lagged.tensors()} if self.lagged is not None else {}

    async def _announce_start(self) -> None:
        c = self.config
        data = {"total_steps": self.total_steps, "batch_size": c.batch_size, "group_size": c.group_size,
                "n_epochs": c.n_epochs, "learning_rate": c.learning_rate, "loss": c.loss, "kl_coef": c.kl_coef,
                "training_mode": c.training_mode, "eval_interval": c.eval_interval, "eval_samples": c.eval_samples,
                "max_staleness": c.max_staleness if self.lookahead is not None else 0,
                "refill_zero_spread": c.refill_zero_spread}
        if c.max_staleness and self.lookahead is None:
            await self._event("warn", "max_staleness 1 is off for this job: with several training processes the "
                                      "in-process engine samples on all of them, between updates. Use a vLLM "
                                      "sampler to sample while training.")
        if c.engine.temperature <= 0:
            await self._event("warn", "temperature is 0: every rollout of a group is the same, so no group has a "
                              "reward spread and nothing can be learned. Use a temperature around 0.7-1.0.")
        if self.progress.step:
            await self._event("info", f"Resumed training at step {self.progress.step} of {self.total_steps}.", data)
        else:
            ahead = "; each step sampled while the previous one updates" if self.lookahead is not None else ""
            await self._event("info", f"Training started: {self.total_steps} steps of {c.batch_size} prompts × "
                              f"{c.group_size} rollouts ({c.loss}, {c.training_mode}{ahead}).", data)

    # -- setup -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        """Build the trainable model, optimizer, reference and engine; restore a saved state."""
        c = self.config
        c.validate()
        if not self.train_rows:
            raise ValueError("the training file has no rows")
        self.grader = load_grader(self.grader)
        job_schemas = job_tool_schemas(self.job_tools)
        self.train_prompts = prompts_from_rows(self.train_rows, job_schemas, source="training")
        valid = prompts_from_rows(self.valid_rows, job_schemas, source="validation")
        self.eval_prompts = fixed_subset(valid or self.train_prompts, c.eval_samples, f"agent-rft/{c.seed}/eval")
        self._build_trainable()
        self.reference = self._make_reference()  # the initial policy: made before a saved state is restored
        tokenizer = self.loaded.tokenizer
        self.engine = RolloutEngine(self.loaded.model, tokenizer, ChatFormatter(tokenizer), self.tool_client, c.engine,
                                    sampler=self.sampler)
        self._build_lookahead()
        self.loss_settings = LossSettings(c.loss, c.clip_epsilon, c.kl_coef, c.engine.temperature,
                                          c.engine.max_tokens_per_rollout, importance_cap=c.importance_cap)
        self._restore_progress(self._fingerprint())

    def _build_lookahead(self) -> None:
        """max_staleness 1: the engine that samples a step ahead: on the vLLM fleet, or in-process on
        a copy of the policy. Not with several training processes sampling in-process (they sample
        their shares through the same channel as their updates)."""
        if not self.config.max_staleness or (self.group.world_size > 1 and not self.engine.sampler.needs_adapter_files):
            return
        self.lookahead = Lookahead()
        tokenizer = self.loaded.tokenizer
        if self.engine.sampler.needs_adapter_files:
            model, sampler = self.loaded.model, self.engine.sampler
        else:
            self.lagged = LaggedPolicy(self.model)
            model, sampler = self.lagged.model, None
        self.ahead_engine = RolloutEngine(model, tokenizer, ChatFormatter(tokenizer), self.tool_client,
                                          self.config.engine, sampler=sampler)

    def _make_reference(self) -> torch.nn.Module | None:
        """The frozen copy of the initial policy for the KL term, only for full training with
        kl_coef > 0 (LoRA's reference is the base model with the adapter disabled)."""
        if self.config.kl_coef <= 0 or self.config.training_mode == "lora":
            return None
        reference = copy.deepcopy(self.model).eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference

    def _fingerprint(self) -> dict[str, Any]:
        c = self.config
        return {"training_mode": c.training_mode, "lora_rank": c.lora_rank, "lora_alpha": c.lora_alpha,
                "loss": c.loss, "seed": c.seed, "batch_size": c.batch_size, "group_size": c.group_size,
                "n_train": len(self.train_rows), "total_steps": self.total_steps}

    # -- one step --------------------------------------------------------------------------------

    async def _train_step(self, step: int) -> StepResult:
        c, clock = self.config, StepClock()
        batch = await self._batch_for(step)
        clock.laps({"sampling": clock.since_last(), "grading": 0.0} if batch.ahead else batch.seconds)
        graded = batch.graded
        self._check_failure_rates(step, graded)
        sequences, zero_spread_groups = train_sequences(graded, c.group_size, c.loss)
        await self._sample_ahead(step, batch.next_position)  # on the policy this update starts from
        stats = await asyncio.to_thread(self._update, sequences)
        await self._publish_policy(step)
        clock.lap("training")
        evaluated = self._evaluates_at(step)
        valid = await self._evaluate() if evaluated else None
        clock.lap("eval")
        metrics = step_metrics(step=step, total_steps=self.total_steps, graded=graded, stats=stats,
                               n_used=len(sequences), zero_spread_groups=zero_spread_groups, n_groups=batch.n_groups,
                               timing=clock.report(batch.cost, stats, ahead=batch.seconds if batch.ahead else None),
                               sampling=batch.cost, valid=valid, learning_rate=self.optimizer.param_groups[0]["lr"],
                               graders=batch.graders, updated_version=step - 1, sampled_ahead=batch.ahead)
        await self._warn_about_exclusions(step, graded)
        await self._report_failovers(step)
        return StepResult(metrics, stats.sampled_tokens, batch.next_position, evaluated,
                          train_records=[g.report() for g in graded],
                          valid_records=valid["records"] if valid else None,
                          valid_reward_mean=valid["reward_mean"] if valid else None)

    async def _batch_for(self, step: int) -> SampledBatch:
        """The step's batch: sampled ahead while the previous step updated, or sampled now."""
        ahead = await self.lookahead.take(step) if self.lookahead is not None else None
        if ahead is not None:
            return ahead
        engine = self.ahead_engine if self.lagged is not None else self.engine  # the lagged copy: resumed runs
        return await self._sample_batch(step, self.progress.position, engine)

    async def _sample_ahead(self, step: int, position: DataPosition) -> None:
        """max_staleness 1: start sampling step + 1 now, before this step's update; in-process, on a
        copy of the policy this update starts from (version step - 1)."""
        if self.lookahead is None or step >= self.total_steps:
            return
        if self.lagged is not None:
            await asyncio.to_thread(self.lagged.refresh, self.model)
            await self.ahead_engine.sampler.publish_policy(step - 1, None)
        self.lookahead.start(step + 1, self._sample_batch(step + 1, position, self.ahead_engine, ahead=True))

    async def _sample_batch(self, step: int, position: DataPosition, engine: RolloutEngine, *,
                            ahead: bool = False) -> SampledBatch:
        """`group_size` rollouts for each of the next `batch_size` prompts, graded; with
        refill_zero_spread, more prompts until `batch_size` groups have a reward spread (at most
        REFILL_LIMIT × batch_size prompts in all). `ahead`: sampled while the previous step updates."""
        c = self.config
        graded: list[GradedRollout] = []
        cost, seconds, wanted = SamplingCost({}, 0), {"sampling": 0.0, "grading": 0.0}, c.batch_size
        grader_load = GraderLoad.of(self.grader_ctx)
        while wanted > 0:
            rows, position = take_batch(position, len(self.train_prompts), c.seed, wanted)
            first = len(graded) // c.group_size  # the slots of prompts drawn again follow the batch's
            specs = [spec_for(self.train_prompts[row], rollout_seed(c.seed, "train", step, first + slot, row, k))
                     for slot, row in enumerate(rows) for k in range(c.group_size)]
            started = time.perf_counter()
            records = await self._rollouts(specs, c.group_size, engine)
            graded_at = time.perf_counter()
            cost = cost.plus(SamplingCost.of(engine))  # read before eval runs the engine again
            graded += await grade_rollouts(self.grader, self.grader_ctx, records, [s.item for s in specs])
            seconds["sampling"] += graded_at - started
            seconds["grading"] += time.perf_counter() - graded_at
            wanted = self._prompts_to_refill(graded)
        graders = GraderLoad.of(self.grader_ctx).since(grader_load)
        return SampledBatch(graded, len(graded) // c.group_size, position, cost, graders, seconds, ahead)

    def _prompts_to_refill(self, graded: list[GradedRollout]) -> int:
        """How many more prompts the step draws: none unless refill_zero_spread, else those still
        missing a reward spread, within REFILL_LIMIT × batch_size prompts drawn."""
        c = self.config
        if not c.refill_zero_spread:
            return 0
        drawn = len(graded) // c.group_size
        missing = c.batch_size - groups_with_spread(graded, c.group_size)
        return max(0, min(missing, REFILL_LIMIT * c.batch_size - drawn))

    def _check_failure_rates(self, step: int, graded: list[GradedRollout]) -> None:
        """Raise StepFailure when the step's tool-failure or grader-failure rate is over its limit."""
        self._check_tool_failures(step, graded)
        self._check_grader_failures(step, [g for g in graded if g.excluded != "tool_failure"])

    def _check_tool_failures(self, step: int, graded: list[GradedRollout]) -> None:
        c = self.config
        tool_failures = [g for g in graded if g.excluded == "tool_failure"]
        tool_rate = len(tool_failures) / len(graded)
        if tool_rate > c.max_tool_failure_rate:
            example = next((call.error for g in tool_failures for call in reversed(g.record.tool_calls)
                            if call.status == "failed" and call.error), "unknown")
            raise StepFailure("tool_failure_rate", (
                f"Step {step}: {len(tool_failures)} of {len(graded)} rollouts ({tool_rate:.0%}) ended in a tool "
                f"failure (a tool call still failed after retries), above the limit of "
                f"{c.max_tool_failure_rate:.0%}. "
                f"Last tool error: {example}"),
                {"step": step, "tool_failure_rate": tool_rate, "threshold": c.max_tool_failure_rate,
                 "tool_failures": len(tool_failures), "rollouts": len(graded)})

    def _check_grader_failures(self, step: int, graded_ok: list[GradedRollout]) -> None:
        c = self.config
        grader_failures = [g for g in graded_ok if g.excluded == "grader_failure"]
        grader_rate = len(grader_failures) / len(graded_ok) if graded_ok else 0.0
        if grader_rate > c.max_grader_failure_rate:
            first = grader_failures[0].grade
            detail = f"{', '.join(first.errors)}: {first.details}" if first else "unknown"
            raise StepFailure("grader_failure_rate", (
                f"Step {step}: grading failed for {len(grader_failures)} of {len(graded_ok)} rollouts "
                f"({grader_rate:.0%}), above the limit of {c.max_grader_failure_rate:.0%}. First failure: {detail}"),
                {"step": step, "grader_failure_rate": grader_rate, "threshold": c.max_grader_failure_rate,
                 "grader_failures": len(grader_failures), "rollouts_graded": len(graded_ok)})

    async def _publish_policy(self, version: int) -> None:
        """Hand the sampler the policy after `version` optimizer steps; a sampler outside this
        process (vLLM) reads the LoRA adapter from work_dir/policy/v<version>."""
        sampler = self.engine.sampler
        if not sampler.needs_adapter_files:
            await sampler.publish_policy(version, None)
            return
        if self.config.training_mode != "lora":
            raise StepFailure("sampler_unsupported", "This sampler samples LoRA policies only.")
        folder = self.work_dir / POLICY_DIR / f"v{version}"
        await asyncio.to_thread(self.model.save_pretrained, str(folder))
        await sampler.publish_policy(version, folder)
        # Sampling ahead, a turn may still run on the previous version: the server keeps it until the next publish.
        kept = {folder.name, f"v{version - 1}"} if self.lookahead is not None else {folder.name}
        for old in (self.work_dir / POLICY_DIR).iterdir():  # the servers unloaded the older versions
            if old.name not in kept:
                await asyncio.to_thread(shutil.rmtree, old, True)

    async def _report_failovers(self, step: int) -> None:
        failovers = self.engine.sampler.failovers
        new, self.failovers_reported = failovers[self.failovers_reported:], len(failovers)
        for server in sorted({f.server for f in new}):
            errors = [f.error for f in new if f.server == server]
            await self._event("warn", f"Step {step}: sampling server {server} failed {len(errors)} time(s) "
                                      f"({errors[-1]}); its requests went to the other servers.",
                              {"server": server, "failures": len(errors), "last_error": errors[-1]})

    def _update(self, sequences: list[TrainSequence]) -> UpdateStats:
        """One optimizer step over every sequence (blocking); with several training processes, each
        takes a share of about equal tokens and their gradients are summed."""
        return self._shared_update(sequences, lambda s: len(s.token_ids), len(sequences))

    def update_share(self, parts: list[list[TrainSequence]], n_sequences: int) -> UpdateStats:
        """This process's part of the step (every rank runs it); the step's statistics on rank 0."""
        c = self.config
        stats = policy_update(self.model, self.optimizer, parts[self.group.rank], settings=self.loss_settings,
                              pad_token_id=self.pad_token_id, micro_batch_tokens=c.micro_batch_tokens,
                              max_grad_norm=c.max_grad_norm, reference=self._reference_logprobs,
                              n_sequences=n_sequences, sync_gradients=self.group.all_reduce_gradients)
        return self._step_statistics(stats, UpdateStats.merged)

    async def _rollouts(self, specs: list, group_size: int, engine: RolloutEngine | None = None) -> list:
        """The rollouts of `specs` in order, on `engine` (default: the one on the trained policy).
        With several training processes and the in-process engine, each samples a share of whole
        groups (advantages compare the rollouts of one group); a sampler of its own (vLLM) samples
        them all."""
        engine = engine or self.engine
        if self.group.world_size == 1 or engine.sampler.needs_adapter_files:
            return await engine.run(specs)
        groups = [specs[i:i + group_size] for i in range(0, len(specs), group_size)]
        parts = [[spec for group in part for spec in group] for part in shares(groups, self.group.world_size)]
        self.group.command("sample_share", parts)
        return await self.sample_share(parts)

    async def sample_share(self, parts: list[list]) -> list:
        """This process's rollouts (every rank runs it); all of them, in order, on rank 0."""
        records = await self.engine.run(parts[self.group.rank])
        gathered = self.group.gather(records)
        return [record for part in gathered for record in part] if gathered is not None else records

    def _reference_logprobs(self, batch: Collated) -> torch.Tensor | None:
        if self.config.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return token_logprobs(self.reference, batch, self.loss_settings.temperature)
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return token_logprobs(self.model, batch, self.loss_settings.temperature)

    # -- eval, metrics, checkpoints, state ---------------------------------------------------------

    async def _evaluate(self) -> dict[str, Any]:
        """One rollout per eval prompt, with the same seeds at every eval."""
        specs = [spec_for(prompt, rollout_seed(self.config.seed, "eval", i))
                 for i, prompt in enumerate(self.eval_prompts)]
        records = await self._rollouts(specs, 1)
        graded = await grade_rollouts(self.grader, self.grader_ctx, records, [s.item for s in specs])
        rewards = [g.reward for g in graded if g.reward is not None]
        return {"reward_mean": mean_or_none(rewards), "sub_rewards": sub_reward_means(graded),
                "records": [g.report() for g in graded]}

    async def _warn_about_exclusions(self, step: int, graded: list[GradedRollout]) -> None:
        tool = sum(1 for g in graded if g.excluded == "tool_failure")
        grader = sum(1 for g in graded if g.excluded == "grader_failure")
        if tool or grader:
            await self._event("warn", f"Step {step}: {tool + grader} of {len(graded)} rollouts excluded from the "
                              f"update ({tool} tool failures, {grader} grader failures).",
                              {"step": step, "tool_failures": tool, "grader_failures": grader})
