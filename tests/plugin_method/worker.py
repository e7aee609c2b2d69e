"""`method.type = "imitate"` on the workers: a trainer on the shared lifecycle whose step is one
cross-entropy update over the next rows' text."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.models.loading import release_freed_memory
from workers.training.data import fixed_subset, take_batch, total_steps_for
from workers.training.distributed.follower import serve
from workers.training.sequences import TrainSequence, collate, target_logits
from workers.training.training_run import StepResult, TrainingRun


@dataclass
class ImitateConfig:
    n_epochs: int
    learning_rate: float
    batch_size: int = 2
    eval_interval: int = 1
    training_mode: str = "lora"
    lora_rank: int = 4
    lora_alpha: int = 8
    seed: int = 0
    state_interval: int = 1


class ImitateTrainer(TrainingRun):
    def __init__(self, *, loaded: Any, config: ImitateConfig, rows: list[dict], valid_rows: list[dict], work_dir: Path,
                 hooks: Any, resume_state: Path | None = None, group: Any = None) -> None:
        super().__init__(loaded=loaded, config=config, work_dir=work_dir, hooks=hooks, resume_state=resume_state,
                         total_steps=total_steps_for(len(rows), config.batch_size, config.n_epochs), group=group)
        self.rows, self.valid_rows = rows, valid_rows

    def _setup(self) -> None:
        encode = self.loaded.tokenizer.encode
        self.train = [TrainSequence(ids, [1] * len(ids), [0.0] * len(ids), 0.0)
                      for ids in (encode(row["text"]) for row in self.rows)]
        self.valid = fixed_subset([TrainSequence(ids, [1] * len(ids), [0.0] * len(ids), 0.0)
                                   for ids in (encode(row["text"]) for row in self.valid_rows)], 8, "imitate")
        self._build_trainable()
        self._restore_progress({"method": "imitate", "seed": self.config.seed, "n_train": len(self.rows)})

    async def _announce_start(self) -> None:
        await self._event("info", f"Imitating {len(self.rows)} rows in {self.total_steps} steps.")

    async def _train_step(self, step: int) -> StepResult:
        rows, position = take_batch(self.progress.position, len(self.train), self.config.seed, self.config.batch_size)
        batch = [self.train[row] for row in rows]
        loss = await asyncio.to_thread(self._update, batch)
        evaluated = self._evaluates_at(step)
        metrics: dict[str, Any] = {"step": step, "total_steps": self.total_steps, "train_loss": loss}
        if evaluated and self.valid:
            metrics["valid_loss"] = await asyncio.to_thread(self._loss, self.valid)
        return StepResult(metrics, sum(len(s.token_ids) for s in batch), position, evaluated)

    def _loss(self, sequences: list[TrainSequence]) -> float:
        with torch.no_grad():
            return float(self._cross_entropy(sequences))

    def _cross_entropy(self, sequences: list[TrainSequence]) -> torch.Tensor:
        batch = collate(sequences, self.pad_token_id, next(self.model.parameters()).device, share_prefix=False)
        logits, targets, _ = target_logits(self.model, batch)
        return torch.nn.functional.cross_entropy(logits, targets)

    def _update(self, sequences: list[TrainSequence]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._cross_entropy(sequences)
        loss.backward()
        self.group.all_reduce_gradients([p for p in self.model.parameters() if p.requires_grad])
        self.optimizer.step()
        release_freed_memory()
        return float(loss.detach())


def _args(run: Any) -> dict[str, Any]:
    block = run.job.method.imitate  # an extra block of the method: a dict, as the API stored it
    return {"config": ImitateConfig(n_epochs=block["n_epochs"], learning_rate=block["learning_rate"], seed=run.job.seed),
            "rows": run.rows(run.job.training_file), "valid_rows": run.rows(run.job.validation_file),
            "work_dir": run.work_dir, "resume_state": Path(run.job.resume_state) if run.job.resume_state else None}


async def train(run: Any) -> Any:
    hooks = run.hooks({"n_epochs": run.job.method.imitate["n_epochs"]})
    loaded = await run.load_start("float32", "lora", hooks)
    return await ImitateTrainer(loaded=loaded, hooks=hooks, **_args(run)).run()


async def follow(group: Any, loaded: Any, args: dict[str, Any]) -> None:
    await serve(group, ImitateTrainer(loaded=loaded, hooks=None, group=group, **args))
