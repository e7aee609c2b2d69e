"""A job's training configuration: the stored `method.reinforcement` with every "auto" resolved
by the rules of docs/training.md, checked once before training starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.methods.reinforcement.advantages import LOSS_VARIANTS
from workers.engine.rollout import EngineConfig
from workers.training.data import total_steps_for

if TYPE_CHECKING:
    from app.jobs.schemas import TrainingOptions

# group_size = clamp(round(GROUP_SIZE_PER_COMPUTE × compute_multiplier), MIN_GROUP_SIZE, MAX_GROUP_SIZE)
GROUP_SIZE_PER_COMPUTE = 4
MIN_GROUP_SIZE, MAX_GROUP_SIZE = 2, 64
AUTO_BATCH_SIZE = 8  # prompts per step, at most the number of training rows
AUTO_TARGET_STEPS = 50  # auto n_epochs repeats a small dataset until about this many steps...
AUTO_MAX_EPOCHS = 10  # ...but never more than this many epochs
AUTO_EVALS_PER_RUN = 10  # auto eval_interval: about this many evals per run
AUTO_MAX_EVAL_SAMPLES = 16
# learning_rate = learning_rate_multiplier × base rate. LoRA wants ~10× the rate of full
# fine-tuning (Schulman et al., "LoRA Without Regret", 2025); 1e-6 is the usual full-RL rate.
BASE_LEARNING_RATE = {"lora": 1e-5, "full": 1e-6}
# The importance-sampling cap of a run whose sampling policy lags (max_staleness >= 1) and whose
# job sets none: the usual value for truncated importance sampling.
LAGGED_IMPORTANCE_CAP = 2.0
REFILL_LIMIT = 4  # refill_zero_spread draws at most this many times batch_size prompts in a step


@dataclass
class TrainingConfig:
    batch_size: int
    n_epochs: int
    group_size: int
    learning_rate: float
    eval_interval: int
    eval_samples: int
    loss: str  # "grpo" | "dr_grpo" | "rloo"
    kl_coef: float
    clip_epsilon: float
    importance_cap: float | None = None  # truncated importance sampling (x_open_model.importance_sampling_cap)
    max_grad_norm: float = 1.0
    training_mode: str = "lora"
    lora_rank: int = 16
    lora_alpha: int = 32
    engine: EngineConfig = field(default_factory=EngineConfig)  # temperature, top_p, token caps, max_episode_steps
    seed: int = 0
    max_tool_failure_rate: float = 0.5  # above this in a step the job fails
    max_grader_failure_rate: float = 0.5
    micro_batch_tokens: int = 2048  # padded tokens per forward/backward; gradients are accumulated
    state_interval: int = 1  # save the resumable state every this many steps (and always on pause)
    max_staleness: int = 0  # 1: the next step is sampled while this one updates (x_open_model.max_staleness)
    refill_zero_spread: bool = False  # draw more prompts until batch_size groups have a reward spread

    def validate(self) -> None:
        """Raise ValueError naming the first option out of range."""
        positive = ("batch_size", "n_epochs", "group_size", "eval_interval", "eval_samples", "micro_batch_tokens",
                    "state_interval", "lora_rank")
        for name in positive:
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (advantages compare the rollouts of a group), "
                             f"got {self.group_size}")
        if self.loss not in LOSS_VARIANTS:
            raise ValueError(f"loss must be one of {', '.join(LOSS_VARIANTS)}, got {self.loss!r}")
        if self.training_mode not in ("lora", "full"):
            raise ValueError(f"training_mode must be 'lora' or 'full', got {self.training_mode!r}")
        if not (self.learning_rate > 0 and self.max_grad_norm > 0 and self.clip_epsilon > 0 and self.kl_coef >= 0):
            raise ValueError("learning_rate, max_grad_norm and clip_epsilon must be positive and kl_coef non-negative")
        if self.max_staleness not in (0, 1):
            raise ValueError(f"max_staleness must be 0 or 1, got {self.max_staleness!r}")
        for name in ("max_tool_failure_rate", "max_grader_failure_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)!r}")


def resolve_hyperparameters(
    training: TrainingOptions, *, n_train: int, n_valid: int, seed: int
) -> tuple[TrainingConfig, dict]:
    """`training` is the job's method.reinforcement (or just its training options: hyperparameters
    with "auto" values, max_episode_steps, x_open_model). Returns the config and the resolved values
    to record on the job: the hyperparameters with every "auto" replaced (same keys, so they still
    validate)."""
    if n_train < 1:
        raise ValueError("the training file has no rows")
    hyper, options = training.hyperparameters, training.x_open_model
    compute = 1.0 if hyper.compute_multiplier == "auto" else float(hyper.compute_multiplier)
    lr_multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else float(hyper.learning_rate_multiplier)
    batch_size = min(n_train, AUTO_BATCH_SIZE) if hyper.batch_size == "auto" else hyper.batch_size
    n_epochs = auto_epochs(n_train, batch_size) if hyper.n_epochs == "auto" else hyper.n_epochs
    total = total_steps_for(n_train, batch_size, n_epochs)
    eval_interval = (max(1, math.ceil(total / AUTO_EVALS_PER_RUN)) if hyper.eval_interval == "auto"
                     else hyper.eval_interval)
    eval_samples = (min(n_valid or n_train, AUTO_MAX_EVAL_SAMPLES) if hyper.eval_samples == "auto"
                    else hyper.eval_samples)
    engine = EngineConfig(
        max_episode_steps=training.max_episode_steps,
        max_tokens_per_turn=options.max_tokens_per_turn, max_tokens_per_rollout=options.max_tokens_per_rollout,
        temperature=options.temperature, top_p=options.top_p, rollout_timeout_s=options.rollout_timeout,
        response_format=getattr(training, "response_format", None),  # method.reinforcement's; none for plain options
    )
    config = TrainingConfig(
        batch_size=batch_size, n_epochs=n_epochs, group_size=group_size_for(compute),
        learning_rate=options.learning_rate or lr_multiplier * BASE_LEARNING_RATE[options.training_mode],
        eval_interval=eval_interval,
        eval_samples=eval_samples, loss=options.loss, kl_coef=options.kl_coef, clip_epsilon=options.clip_epsilon,
        importance_cap=options.importance_sampling_cap or (LAGGED_IMPORTANCE_CAP if options.max_staleness else None),
        max_staleness=options.max_staleness, refill_zero_spread=options.refill_zero_spread,
        training_mode=options.training_mode, lora_rank=options.lora_rank, lora_alpha=options.lora_alpha,
        engine=engine, seed=seed,
    )
    resolved = {"batch_size": batch_size, "n_epochs": n_epochs, "learning_rate_multiplier": lr_multiplier,
                "compute_multiplier": compute, "eval_interval": eval_interval, "eval_samples": eval_samples,
                "reasoning_effort": hyper.reasoning_effort}
    return config, resolved


def group_size_for(compute_multiplier: float) -> int:
    return max(MIN_GROUP_SIZE, min(MAX_GROUP_SIZE, round(GROUP_SIZE_PER_COMPUTE * compute_multiplier)))


def auto_epochs(n_train: int, batch_size: int) -> int:
    return max(1, min(AUTO_MAX_EPOCHS, math.ceil(AUTO_TARGET_STEPS * batch_size / n_train)))
