"""The supervised trainer: the shared training lifecycle (workers/training/training_run.py: pause,
cancel, checkpoints, resumable state) with a cross-entropy step. One step reads top to bottom:

1. batch: the next `batch_size` rows of the seeded data stream (as reinforcement jobs take them);
2. update: one optimizer step on the rows' assistant tokens (workers/methods/supervised/loss.py); the step's
   `train_loss` and `train_mean_token_accuracy` are those of the weights before it;
3. every `eval_interval` steps: `valid_loss`, `valid_mean_token_accuracy` on a fixed subset of the
   validation rows, and a checkpoint; at the last step `full_valid_*` on every validation row;
4. the step's metrics (OpenAI's names), returned: the lifecycle reports them, checkpoints an
   eval step and saves the resumable state.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from workers.training.data import fixed_subset, take_batch
from workers.training.data import total_steps_for
from workers.models.registry import LoadedModel
from workers.engine.prompting import ChatFormatter
from workers.training.training_run import StepFailure, StepResult, TrainingHooks, TrainingRun
from workers.training.sequences import TrainSequence
from workers.methods.supervised.data import BadExample, examples_from_rows
from workers.methods.supervised.hyperparameters import SupervisedConfig
from workers.training.distributed.group import TrainingGroup
from workers.methods.supervised.loss import TokenScores, learned_tokens, score, supervised_update


class SupervisedTrainer(TrainingRun):
    def __init__(self, *, loaded: LoadedModel, config: SupervisedConfig, train_rows: list[dict],
                 valid_rows: list[dict], work_dir: Path, hooks: TrainingHooks | None,
                 resume_state: Path | None = None, group: TrainingGroup | None = None) -> None:
        super().__init__(loaded=loaded, config=config, work_dir=work_dir, hooks=hooks, resume_state=resume_state,
                         total_steps=total_steps_for(len(train_rows), config.batch_size, config.n_epochs), group=group)
        self.train_rows, self.valid_rows = train_rows, valid_rows

    # -- setup -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        c = self.config
        if not self.train_rows:
            raise ValueError("the training file has no rows")
        formatter = ChatFormatter(self.loaded.tokenizer)
        try:
            self.train = examples_from_rows(self.train_rows, formatter, max_tokens=c.max_seq_tokens, source="training")
            self.valid = examples_from_rows(self.valid_rows, formatter, max_tokens=c.max_seq_tokens,
                                            source="validation")
        except BadExample as exc:
            raise StepFailure("invalid_training_file", f"{exc}") from exc
        self.valid_subset = fixed_subset(self.valid.sequences, c.valid_samples, f"agent-rft/{c.seed}/valid")
        self._build_trainable()
        self._restore_progress({"method": "supervised", "training_mode": c.training_mode, "lora_rank": c.lora_rank,
                                "lora_alpha": c.lora_alpha, "seed": c.seed, "batch_size": c.batch_size,
                                "n_train": len(self.train_rows), "total_steps": self.total_steps})

    async def _announce_start(self) -> None:
        c = self.config
        data = {"total_steps": self.total_steps, "batch_size": c.batch_size, "n_epochs": c.n_epochs,
                "learning_rate": c.learning_rate, "training_mode": c.training_mode, "eval_interval": c.eval_interval,
                "trained_tokens_per_epoch": self.train.trained_tokens, "truncated_rows": self.train.truncated}
        if self.train.truncated:
            await self._event("warn", f"{self.train.truncated} of {len(self.train_rows)} training rows are longer than "
                              f"max_seq_tokens ({c.max_seq_tokens}) and were truncated.", data)
        if self.progress.step:
            await self._event("info", f"Resumed supervised training at step {self.progress.step} of "
                              f"{self.total_steps}.", data)
        else:
            await self._event("info", f"Supervised training started: {self.total_steps} steps of {c.batch_size} "
                              f"examples ({c.training_mode}).", data)

    # -- one step --------------------------------------------------------------------------------

    async def _train_step(self, step: int) -> StepResult:
        c, started = self.config, time.perf_counter()
        rows, next_position = take_batch(self.progress.position, len(self.train.sequences), c.seed, c.batch_size)
        batch = [self.train.sequences[row] for row in rows]
        trained = await asyncio.to_thread(self._update, batch)
        evaluated = self._evaluates_at(step)
        valid, full_valid = await self._validation(step, evaluated, self.valid_subset, self.valid.sequences)
        metrics = _step_metrics(step, self.total_steps, trained, valid, full_valid,
                                learning_rate=self.optimizer.param_groups[0]["lr"],
                                step_s=time.perf_counter() - started)
        return StepResult(metrics, sum(len(s.token_ids) for s in batch), next_position, evaluated)

    def _update(self, sequences: list[TrainSequence]) -> TokenScores:
        """One optimizer step over the rows (blocking); with several training processes each takes
        a share of about equal tokens and their gradients are summed."""
        return self._shared_update(sequences, lambda s: len(s.token_ids), learned_tokens(sequences))

    def update_share(self, parts: list[list[TrainSequence]], step_tokens: int) -> TokenScores:
        """This process's part of the step (every rank runs it); the step's scores on rank 0."""
        c = self.config
        scores = supervised_update(self.model, self.optimizer, parts[self.group.rank], pad_token_id=self.pad_token_id,
                                   micro_batch_tokens=c.micro_batch_tokens, max_grad_norm=c.max_grad_norm,
                                   step_tokens=step_tokens, sync_gradients=self.group.all_reduce_gradients)
        return self._step_statistics(scores, TokenScores.merged)

    async def _score(self, sequences: list[TrainSequence]) -> TokenScores:
        return await asyncio.to_thread(score, self.model, sequences, pad_token_id=self.pad_token_id,
                                       micro_batch_tokens=self.config.micro_batch_tokens)


def _step_metrics(step: int, total_steps: int, trained: TokenScores, valid: TokenScores | None,
                  full_valid: TokenScores | None, *, learning_rate: float, step_s: float) -> dict[str, Any]:
    """OpenAI's metrics for a supervised step (its event's `data`), plus the `train` and `timing` blocks."""
    metrics: dict[str, Any] = {"step": step, "total_steps": total_steps, "train_loss": trained.loss,
                               "train_mean_token_accuracy": trained.accuracy}
    for prefix, scores in (("valid", valid), ("full_valid", full_valid)):
        if scores is not None:
            metrics[f"{prefix}_loss"], metrics[f"{prefix}_mean_token_accuracy"] = scores.loss, scores.accuracy
    metrics["train"] = {"learned_tokens": trained.tokens, "grad_norm": trained.grad_norm,
                        "learning_rate": learning_rate}
    metrics["timing"] = {"step_s": step_s}
    return metrics
