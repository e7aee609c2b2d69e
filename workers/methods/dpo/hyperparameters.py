"""A DPO job's configuration: the stored `method.dpo` with every "auto" resolved.

Auto rules: `beta` = 0.1 (the DPO paper's and TRL's default); `batch_size`, `n_epochs` and the
evaluation cadence as a supervised job's (workers/methods/supervised/hyperparameters.py); `learning_rate` =
multiplier (auto 1) × 5e-5 for LoRA, 1e-6 for full fine-tuning: preference updates push the two
answers apart, and at supervised rates the policy leaves the reference within a few steps."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workers.methods.supervised.hyperparameters import SupervisedConfig, resolve_supervised

AUTO_BETA = 0.1
BASE_LEARNING_RATE = {"lora": 5e-5, "full": 1e-6}


@dataclass
class DpoConfig(SupervisedConfig):
    beta: float = AUTO_BETA


def resolve_dpo(dpo: Any, *, n_train: int, seed: int) -> tuple[DpoConfig, dict[str, Any]]:
    """`dpo` is the job's method.dpo. Returns the config and the hyperparameters with every "auto"
    replaced, to record on the job: a supervised job's rules, DPO's learning rates, and beta."""
    config, resolved = resolve_supervised(dpo, n_train=n_train, seed=seed, base_learning_rate=BASE_LEARNING_RATE)
    beta = AUTO_BETA if dpo.hyperparameters.beta == "auto" else float(dpo.hyperparameters.beta)
    return DpoConfig(**asdict(config), beta=beta), {**resolved, "beta": beta}
