"""A DPO job's configuration: the stored `method.dpo` with every "auto" resolved.

Auto rules: `beta` = 0.1 (the DPO paper's and TRL's default); `batch_size`, `n_epochs` and the
evaluation cadence as a supervised job's (workers/methods/supervised/hyperparameters.py); `learning_rate` =
multiplier (auto 1) × 5e-5 for LoRA, 1e-6 for full fine-tuning: preference updates push the two
answers apart, and at supervised rates the policy leaves the reference within a few steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workers.training.data import total_steps_for
from workers.methods.supervised.hyperparameters import AUTO_BATCH_SIZE, AUTO_EVALS_PER_RUN, SupervisedConfig, auto_epochs

AUTO_BETA = 0.1
BASE_LEARNING_RATE = {"lora": 5e-5, "full": 1e-6}


@dataclass
class DpoConfig(SupervisedConfig):
    beta: float = AUTO_BETA


def resolve_dpo(dpo: Any, *, n_train: int, seed: int) -> tuple[DpoConfig, dict[str, Any]]:
    """`dpo` is the job's method.dpo. Returns the config and the hyperparameters with every "auto"
    replaced, to record on the job."""
    if n_train < 1:
        raise ValueError("the training file has no rows")
    hyper, options = dpo.hyperparameters, dpo.x_open_model
    batch_size = min(n_train, AUTO_BATCH_SIZE) if hyper.batch_size == "auto" else int(hyper.batch_size)
    n_epochs = auto_epochs(n_train) if hyper.n_epochs == "auto" else int(hyper.n_epochs)
    multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else float(hyper.learning_rate_multiplier)
    beta = AUTO_BETA if hyper.beta == "auto" else float(hyper.beta)
    total = total_steps_for(n_train, batch_size, n_epochs)
    config = DpoConfig(
        batch_size=batch_size, n_epochs=n_epochs, beta=beta,
        learning_rate=options.learning_rate or multiplier * BASE_LEARNING_RATE[options.training_mode],
        eval_interval=options.eval_interval or max(1, math.ceil(total / AUTO_EVALS_PER_RUN)),
        training_mode=options.training_mode, lora_rank=options.lora_rank, lora_alpha=options.lora_alpha,
        max_seq_tokens=options.max_seq_tokens, seed=seed)
    resolved = {"batch_size": batch_size, "n_epochs": n_epochs, "learning_rate_multiplier": multiplier, "beta": beta}
    return config, resolved
