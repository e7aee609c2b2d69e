"""Sampling a step ahead (`x_open_model.max_staleness = 1`): the rollouts of step N+1 are sampled
and graded while step N updates, so that slow tools and the update stop waiting for each other.

The step ahead samples a policy at most one version older than the one its update starts from,
and the update corrects for it by truncated importance sampling (update.py). Each turn records the
version that sampled it (RolloutRecord.policy_versions).

- In-process engine: sampling swaps the sampled module's weights for a session's length (merged
  LoRA, packed layouts: workers/models/cpu) and the trainer's module changes at every optimizer
  step, so the step ahead samples a copy of the policy (`LaggedPolicy`), refreshed from the trainer
  just before each update: step N+1 is sampled by exactly the policy of step N−1, whatever the
  timing, and the copy is saved with the state, so a resumed run samples what an uninterrupted one
  would. The copy costs the model's memory once more.
- vLLM fleet: the step ahead samples each turn on the newest adapter published when the turn
  starts, so a rollout's turns may span versions N−1 and N (vllm_sampler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Coroutine
from typing import Any

import torch

from workers.training.training_state import copy_tensors

LAGGED_POLICY = "lagged_policy"  # the copy's trained tensors, saved with the training state under this name


class LaggedPolicy:
    """A copy of the policy being trained, for the in-process engine to sample a step ahead on."""

    def __init__(self, trained: torch.nn.Module) -> None:
        self.names = [name for name, param in trained.named_parameters() if param.requires_grad]
        self.model = copy.deepcopy(trained).eval()
        for param in self.model.parameters():
            param.requires_grad_(False)

    def refresh(self, trained: torch.nn.Module) -> None:
        """Take the trainer's current weights (call it while nothing updates them)."""
        self.load(dict(trained.named_parameters()))

    def tensors(self) -> dict[str, torch.Tensor]:
        own = dict(self.model.named_parameters())
        return {name: own[name] for name in self.names}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        copy_tensors(tensors, self.tensors())


class Lookahead:
    """The next step's batch, sampled in the background; at most one at a time."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.task: asyncio.Task[Any] | None = None

    def start(self, step: int, sampling: Coroutine[Any, Any, Any]) -> None:
        self.step, self.task = step, asyncio.create_task(sampling, name=f"sample step {step} ahead")

    async def take(self, step: int) -> Any:
        """The batch sampled ahead for `step` (its sampling's exception, if it failed); None when
        none was started for it."""
        if self.task is None or self.step != step:
            await self.stop()
            return None
        task, self.task, self.step = self.task, None, None
        return await task

    async def stop(self) -> None:
        """Give up the batch being sampled ahead (a pause, a cancel, the run's end)."""
        task, self.task, self.step = self.task, None, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
