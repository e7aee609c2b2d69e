"""Supervised fine-tuning of a claimed job (`method.type = "supervised"`, docs/supervised.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.tasks import ControlHooks

if TYPE_CHECKING:
    from workers.tasks import JobRun


async def train(run: JobRun) -> Any:
    from workers.sft.hyperparameters import resolve_supervised
    from workers.sft.trainer import SupervisedTrainer

    job, supervised = run.job, run.job.method.supervised
    train_rows, valid_rows = run.rows(job.training_file), run.rows(job.validation_file)
    config, resolved = resolve_supervised(supervised, n_train=len(train_rows), seed=job.seed)
    hooks = ControlHooks(run, resolved)
    await hooks.on_event("info", f"Training {job.model} on {len(train_rows)} rows (supervised); "
                                 f"hyperparameters: {json.dumps(resolved, sort_keys=True)}", {"hyperparameters": resolved})
    loaded = await run.load_start(supervised.x_open_model.dtype, config.training_mode, hooks)
    trainer = SupervisedTrainer(loaded=loaded, config=config, train_rows=train_rows, valid_rows=valid_rows,
                                work_dir=run.work_dir, hooks=hooks,
                                resume_state=Path(job.resume_state) if job.resume_state else None)
    return await trainer.run()
