"""A reinforcement job's training processes beyond the first (ranks 1..N-1): each builds the same
trainer as rank 0 (same start weights, LoRA initialisation, optimizer and restored state), then
runs the parts of each step rank 0 hands out: a share of the rollouts, a share of the update.
They never talk to the control plane, never grade, never write checkpoints."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.distributed.group import ProcessGroup
from workers.distributed.launch import serve_commands


@dataclass
class FollowerJob:
    """What a follower needs to build rank 0's trainer (pickled into the spawned process)."""

    model: str
    start_from: Any  # the job's StartFrom, or None
    dtype: str
    threads: int | None  # torch CPU threads per process (the node's cores shared out); None on a GPU
    config: Any  # the resolved TrainingConfig
    train_rows: list[dict]
    valid_rows: list[dict]
    grader: Any
    tools: list[Any]
    allowlist: list[str]
    work_dir: str
    resume_state: str | None


def follow(group: ProcessGroup, job: FollowerJob) -> None:
    asyncio.run(_follow(group, job))


async def _follow(group: ProcessGroup, job: FollowerJob) -> None:
    import torch

    from workers.rl.models import load_start
    from workers.rl.tools_client import ToolClient
    from workers.rl.trainer import Trainer

    from workers.spans import configure_from_environment

    configure_from_environment()  # this rank's rollouts get spans too (the environment is rank 0's)
    if job.threads:
        torch.set_num_threads(job.threads)
    loaded, _ = load_start(job.model, job.start_from, dtype=job.dtype, training_mode=job.config.training_mode)
    async with ToolClient(job.tools, allowlist=job.allowlist) as tools:
        trainer = Trainer(loaded=loaded, config=job.config, train_rows=job.train_rows, valid_rows=job.valid_rows,
                          grader=job.grader, grader_ctx=None, tool_client=tools, job_tools=job.tools,
                          work_dir=Path(job.work_dir), hooks=None,
                          resume_state=Path(job.resume_state) if job.resume_state else None, group=group)
        await asyncio.to_thread(trainer._setup)
        group.broadcast_parameters(trainer.model)
        await serve_commands(group, trainer)
