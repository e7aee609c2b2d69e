"""Group-relative advantages of the GRPO family, and the per-token policy objective.

Every prompt of a step is sampled `group_size` times; a rollout's advantage says how much better
its reward is than its group's. Groups whose rewards are all equal carry no gradient (every
advantage would be 0), so they are skipped and counted (`frac_reward_zero_std`, docs/training.md).

Loss variants (the `loss` option of `x_open_model`):
- `grpo`: A = (r - mean) / (std + eps), std the sample standard deviation of the group (as TRL);
  each sequence's loss is the mean over its sampled tokens (DeepSeekMath's GRPO).
- `dr_grpo`: A = r - mean, no division by the std (Dr. GRPO, Liu et al. 2025: the std favours
  groups that are nearly solved or nearly hopeless); each sequence's loss is the sum over its
  sampled tokens divided by a constant token budget (max_tokens_per_rollout), so a long answer
  is not weighted less per token than a short one.
- `rloo`: A = r - mean of the OTHER rollouts of the group (REINFORCE leave-one-out, Ahmadian et
  al. 2024), an unbiased baseline; per-sequence token means as grpo.

Pure Python and torch tensors; no model code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

LOSS_VARIANTS = ("grpo", "dr_grpo", "rloo")
STD_EPS = 1e-4  # as TRL: keeps a group with a tiny spread from getting huge advantages
ZERO_SPREAD = 1e-9  # rewards closer than this count as equal


def has_reward_spread(rewards: Sequence[float]) -> bool:
    """True when the group can teach something: at least two rewards that differ."""
    return len(rewards) >= 2 and max(rewards) - min(rewards) > ZERO_SPREAD


def group_advantages(rewards: Sequence[float], loss: str) -> list[float] | None:
    """The advantages of one group's rollouts, in order; None when the group has no reward spread
    (or fewer than two rollouts), i.e. it must be skipped."""
    if loss not in LOSS_VARIANTS:
        raise ValueError(f"loss must be one of {', '.join(LOSS_VARIANTS)}, got {loss!r}")
    if not has_reward_spread(rewards):
        return None
    n = len(rewards)
    mean = sum(rewards) / n
    if loss == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [(r - mean) / (std + STD_EPS) for r in rewards]
    if loss == "dr_grpo":
        return [r - mean for r in rewards]
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def sequence_normaliser(loss: str, sampled_tokens: torch.Tensor, token_budget: int) -> torch.Tensor:
    """What each sequence's summed token loss is divided by: its own number of sampled tokens
    (grpo, rloo) or the constant token budget (dr_grpo)."""
    if loss == "dr_grpo":
        return torch.full_like(sampled_tokens, float(max(1, token_budget)))
    return sampled_tokens.clamp(min=1)


def clipped_token_objective(
    new_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, clip_epsilon: float
) -> torch.Tensor:
    """PPO's clipped surrogate per token: min(ρA, clip(ρ, 1-ε, 1+ε)A), ρ = exp(logp_new - logp_sampled).
    `advantages` broadcasts over tokens (one value per sequence)."""
    ratio = torch.exp(new_logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
    return torch.minimum(ratio * advantages, clipped * advantages)


def clipped_tokens(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float) -> int:
    """How many tokens the PPO clip binds on, i.e. gets no gradient from: a ratio above 1 + epsilon
    where the advantage is positive, below 1 - epsilon where it is negative (TRL's GRPOTrainer
    counts the same). A ratio outside the band on the other side still gets its gradient."""
    binds = ((ratio > 1 + epsilon) & (advantages > 0)) | ((ratio < 1 - epsilon) & (advantages < 0))
    return int(binds.sum())


def k3_kl(new_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy ‖ reference) on tokens sampled from the policy:
    exp(ref - new) - (ref - new) - 1 (Schulman's k3: unbiased, always ≥ 0)."""
    delta = reference_logprobs - new_logprobs
    return torch.exp(delta) - delta - 1.0
