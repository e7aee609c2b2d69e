"""A supervised job's configuration: the stored `method.supervised` with every "auto" resolved.

Auto rules: `batch_size` = min(rows, 8); `n_epochs` = enough passes to see about 300 examples,
between 1 and 10 (at most 3 once there are 100 rows, as OpenAI's default of 3 epochs);
`learning_rate` = multiplier (auto 1) × 2e-4 for LoRA, 2e-5 for full fine-tuning (the usual SFT
rates: LoRA wants about ten times the full rate); `eval_interval` about 10 evaluations per run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workers.training.data import total_steps_for

AUTO_BATCH_SIZE = 8
AUTO_EXAMPLES_SEEN = 300
AUTO_MAX_EPOCHS, AUTO_MAX_EPOCHS_LARGE, LARGE_DATASET = 10, 3, 100
AUTO_EVALS_PER_RUN = 10
BASE_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}
VALID_SAMPLES = 32  # validation rows scored at each eval step (all of them at the end: full_valid_*)


@dataclass
class SupervisedConfig:
    batch_size: int
    n_epochs: int
    learning_rate: float
    eval_interval: int
    training_mode: str = "lora"
    lora_rank: int = 16
    lora_alpha: int = 32
    max_seq_tokens: int = 4096
    seed: int = 0
    valid_samples: int = VALID_SAMPLES
    micro_batch_tokens: int = 2048  # padded tokens per forward/backward; gradients are accumulated
    max_grad_norm: float = 1.0
    state_interval: int = 1


def resolve_supervised(supervised: Any, *, n_train: int, seed: int, base_learning_rate: dict[str, float] | None = None
                       ) -> tuple[SupervisedConfig, dict[str, Any]]:
    """`supervised` is the job's method.supervised (or a block of the same shape: DPO's). Returns the
    config and the hyperparameters with every "auto" replaced, to record on the job."""
    if n_train < 1:
        raise ValueError("the training file has no rows")
    hyper, options = supervised.hyperparameters, supervised.x_open_model
    batch_size = min(n_train, AUTO_BATCH_SIZE) if hyper.batch_size == "auto" else int(hyper.batch_size)
    n_epochs = auto_epochs(n_train) if hyper.n_epochs == "auto" else int(hyper.n_epochs)
    multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else float(hyper.learning_rate_multiplier)
    total = total_steps_for(n_train, batch_size, n_epochs)
    config = SupervisedConfig(
        batch_size=batch_size, n_epochs=n_epochs,
        learning_rate=options.learning_rate or multiplier * (base_learning_rate or BASE_LEARNING_RATE)[options.training_mode],
        eval_interval=options.eval_interval or max(1, math.ceil(total / AUTO_EVALS_PER_RUN)),
        training_mode=options.training_mode, lora_rank=options.lora_rank, lora_alpha=options.lora_alpha,
        max_seq_tokens=options.max_seq_tokens, seed=seed)
    resolved = {"batch_size": batch_size, "n_epochs": n_epochs, "learning_rate_multiplier": multiplier}
    return config, resolved


def auto_epochs(n_train: int) -> int:
    cap = AUTO_MAX_EPOCHS_LARGE if n_train >= LARGE_DATASET else AUTO_MAX_EPOCHS
    return max(1, min(cap, math.ceil(AUTO_EXAMPLES_SEEN / n_train)))
