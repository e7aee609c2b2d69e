"""Direct preference optimization of a claimed job (`method.type = "dpo"`, docs/dpo.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.tasks import JobRun


async def train(run: JobRun) -> Any:
    from workers.methods.dpo.hyperparameters import resolve_dpo
    from workers.methods.dpo.trainer import DpoTrainer

    job, dpo = run.job, run.job.method.dpo
    train_rows, valid_rows = run.rows(job.training_file), run.rows(job.validation_file)
    config, resolved = resolve_dpo(dpo, n_train=len(train_rows), seed=job.seed)
    hooks = run.hooks(resolved)
    await hooks.on_event("info", f"Training {job.model} on {len(train_rows)} preference pairs (DPO); "
                                 f"hyperparameters: {json.dumps(resolved, sort_keys=True)}", {"hyperparameters": resolved})
    loaded = await run.load_start(dpo.x_open_model.dtype, config.training_mode, hooks)
    args = {"config": config, "train_rows": train_rows, "valid_rows": valid_rows, "work_dir": run.work_dir,
            "resume_state": Path(job.resume_state) if job.resume_state else None}
    async with run.training_processes(loaded, config.training_mode, args, hooks) as group:
        return await DpoTrainer(loaded=loaded, hooks=hooks, group=group, **args).run()


async def follow(group: Any, loaded: Any, args: dict[str, Any]) -> None:
    """A follower's trainer (workers/training/distributed/follower.py)."""
    from workers.training.distributed.follower import serve
    from workers.methods.dpo.trainer import DpoTrainer

    await serve(group, DpoTrainer(loaded=loaded, hooks=None, group=group, **args))
