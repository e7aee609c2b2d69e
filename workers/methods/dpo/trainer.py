"""The DPO trainer: the shared training lifecycle (workers/training/training_run.py: pause, cancel,
checkpoints, resumable state, data-parallel processes) with a preference step. Setup renders the
pairs and scores them once under the starting model, the reference (before a saved state is
restored, so a resumed run has the same reference). One step reads top to bottom:

1. batch: the next `batch_size` pairs of the seeded data stream (as the other methods take rows);
2. update: one optimizer step of the DPO loss (workers/methods/dpo/loss.py), shared out over the training
   processes; the step's `train_*` metrics are those of the weights before it;
3. every `eval_interval` steps: the same metrics on a fixed subset of the validation pairs (a
   checkpoint follows), and at the last step `full_valid_*` on every validation pair.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from workers.training.distributed.group import TrainingGroup
from workers.methods.dpo.data import Pair, Pairs, pairs_from_rows
from workers.methods.dpo.hyperparameters import DpoConfig
from workers.methods.dpo.loss import PairScores, dpo_update, reference_logprobs, score_pairs
from workers.training.data import fixed_subset, take_batch
from workers.training.data import total_steps_for
from workers.models.registry import LoadedModel
from workers.engine.prompting import ChatFormatter
from workers.training.training_run import StepFailure, StepResult, TrainingHooks, TrainingRun
from workers.methods.supervised.data import BadExample


class DpoTrainer(TrainingRun):
    def __init__(self, *, loaded: LoadedModel, config: DpoConfig, train_rows: list[dict], valid_rows: list[dict],
                 work_dir: Path, hooks: TrainingHooks | None, resume_state: Path | None = None,
                 group: TrainingGroup | None = None) -> None:
        super().__init__(loaded=loaded, config=config, work_dir=work_dir, hooks=hooks, resume_state=resume_state,
                         total_steps=total_steps_for(len(train_rows), config.batch_size, config.n_epochs), group=group)
        self.train_rows, self.valid_rows = train_rows, valid_rows

    # -- setup -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        c = self.config
        if not self.train_rows:
            raise ValueError("the training file has no rows")
        self.train, self.valid = self._pairs(self.train_rows, "training"), self._pairs(self.valid_rows, "validation")
        self.valid_subset = fixed_subset(self.valid.pairs, c.valid_samples, f"agent-rft/{c.seed}/valid")
        self._build_trainable()
        if self.group.rank == 0:  # rank 0 hands every other process its pairs with their reference
            reference_logprobs(self.model, self.train.pairs + self.valid.pairs, pad_token_id=self.pad_token_id,
                               micro_batch_tokens=c.micro_batch_tokens)
        self._restore_progress({"method": "dpo", "training_mode": c.training_mode, "lora_rank": c.lora_rank,
                                "lora_alpha": c.lora_alpha, "seed": c.seed, "batch_size": c.batch_size,
                                "beta": c.beta, "n_train": len(self.train_rows), "total_steps": self.total_steps})

    def _pairs(self, rows: list[dict], source: str) -> Pairs:
        try:
            return pairs_from_rows(rows, ChatFormatter(self.loaded.tokenizer), max_tokens=self.config.max_seq_tokens,
                                   source=source)
        except BadExample as exc:
            raise StepFailure("invalid_training_file", f"{exc}") from exc

    async def _announce_start(self) -> None:
        c = self.config
        data = {"total_steps": self.total_steps, "batch_size": c.batch_size, "n_epochs": c.n_epochs, "beta": c.beta,
                "learning_rate": c.learning_rate, "training_mode": c.training_mode, "eval_interval": c.eval_interval,
                "truncated_rows": self.train.truncated}
        if self.train.truncated:
            await self._event("warn", f"{self.train.truncated} of {len(self.train_rows)} training pairs are longer "
                              f"than max_seq_tokens ({c.max_seq_tokens}) and were truncated.", data)
        if self.progress.step:
            await self._event("info", f"Resumed DPO training at step {self.progress.step} of {self.total_steps}.",
                              data)
        else:
            await self._event("info", f"DPO training started: {self.total_steps} steps of {c.batch_size} pairs "
                              f"(beta {c.beta}, {c.training_mode}).", data)

    # -- one step --------------------------------------------------------------------------------

    async def _train_step(self, step: int) -> StepResult:
        c, started = self.config, time.perf_counter()
        rows, next_position = take_batch(self.progress.position, len(self.train.pairs), c.seed, c.batch_size)
        batch = [self.train.pairs[row] for row in rows]
        trained = await asyncio.to_thread(self._update, batch)
        evaluated = self._evaluates_at(step)
        valid, full_valid = await self._validation(step, evaluated, self.valid_subset, self.valid.pairs)
        metrics = step_metrics(step, self.total_steps, trained, valid, full_valid,
                               learning_rate=self.optimizer.param_groups[0]["lr"], step_s=time.perf_counter() - started)
        return StepResult(metrics, sum(pair.tokens for pair in batch), next_position, evaluated)

    def _update(self, pairs: list[Pair]) -> PairScores:
        """One optimizer step over the pairs (blocking); with several training processes each takes
        a share of about equal tokens and their gradients are summed."""
        return self._shared_update(pairs, lambda pair: pair.tokens, len(pairs))

    def update_share(self, parts: list[list[Pair]], n_pairs: int) -> PairScores:
        """This process's part of the step (every rank runs it); the step's scores on rank 0."""
        c = self.config
        scores = dpo_update(self.model, self.optimizer, parts[self.group.rank], beta=c.beta,
                            pad_token_id=self.pad_token_id, micro_batch_tokens=c.micro_batch_tokens,
                            max_grad_norm=c.max_grad_norm, n_pairs=n_pairs,
                            sync_gradients=self.group.all_reduce_gradients)
        return self._step_statistics(scores, PairScores.merged)

    async def _score(self, pairs: list[Pair]) -> PairScores:
        c = self.config
        return await asyncio.to_thread(score_pairs, self.model, pairs, beta=c.beta, pad_token_id=self.pad_token_id,
                                       micro_batch_tokens=c.micro_batch_tokens)


def step_metrics(step: int, total_steps: int, trained: PairScores, valid: PairScores | None,
                 full_valid: PairScores | None, *, learning_rate: float, step_s: float) -> dict[str, Any]:
    """A DPO step's metrics event: OpenAI's `train_loss`, `valid_loss`, `full_valid_loss` (the DPO
    loss) with, under the same prefixes, the preference accuracy, the reward margin and the
    policy's log-prob margin; then the `train` and `timing` blocks."""
    metrics: dict[str, Any] = {"step": step, "total_steps": total_steps}
    for prefix, scores in (("train", trained), ("valid", valid), ("full_valid", full_valid)):
        if scores is not None and scores.pairs:
            metrics.update({f"{prefix}_{name}": value for name, value in scores.means().items()})
    metrics["train"] = {"pairs": trained.pairs, "learned_tokens": trained.learned_tokens,
                        "grad_norm": trained.grad_norm, "learning_rate": learning_rate}
    metrics["timing"] = {"step_s": step_s}
    return metrics
