"""A job's training processes beyond the first (ranks 1..N-1), whatever its method: each loads the
job's starting weights and builds the same trainer as rank 0 (same LoRA initialisation, optimizer
and restored state), through its method's `follow` (workers/methods/), then runs the parts of each
step rank 0 hands out. Followers never talk to the control plane and never write checkpoints."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from workers.training.distributed.group import ProcessGroup
from workers.training.distributed.launch import serve_commands


@dataclass
class FollowerJob:
    """What a follower needs to build rank 0's trainer (pickled into the spawned process)."""

    method: str  # the module of the job's method (workers/methods/), which builds the trainer
    model: str
    start_from: Any  # the job's StartFrom, or None
    dtype: str
    training_mode: str
    threads: int | None  # torch CPU threads per process (the node's cores shared out); None on a GPU
    trainer: dict[str, Any]  # the method's trainer arguments, as rank 0 builds its trainer with them


def follow(group: ProcessGroup, job: FollowerJob) -> None:
    asyncio.run(_follow(group, job))


async def _follow(group: ProcessGroup, job: FollowerJob) -> None:
    import importlib

    import torch

    from workers.models.lora import load_start
    from workers.spans import configure_from_environment

    configure_from_environment()  # this rank's work gets spans too (the environment is rank 0's)
    if job.threads:
        torch.set_num_threads(job.threads)
    loaded, _ = load_start(job.model, job.start_from, dtype=job.dtype, training_mode=job.training_mode)
    await importlib.import_module(job.method).follow(group, loaded, job.trainer)


async def serve(group: ProcessGroup, trainer: Any) -> None:
    """Set up `trainer` as rank 0 sets up its own, take rank 0's weights, then run its commands."""
    await asyncio.to_thread(trainer._setup)
    group.broadcast_parameters(trainer.model)
    await serve_commands(group, trainer)
