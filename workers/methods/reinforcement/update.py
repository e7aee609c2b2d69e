"""The policy-gradient update: rollouts as the loss sees them (the exact sampled ids and their
sampling log-probs, workers/training/sequences.py), group-relative advantages, the trainer's
log-probs of the sampled tokens, the clipped objective with optional k3 KL, and one optimizer step
with its statistics. The formulas are advantages.py; docs/training.md explains them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from workers.engine.grading import GradedRollout
from workers.methods.reinforcement.advantages import (
    clipped_token_objective,
    clipped_tokens,
    group_advantages,
    has_reward_spread,
    k3_kl,
    sequence_normaliser,
)
from workers.models.loading import release_freed_memory
from workers.training.sequences import (
    Collated,
    ReferenceLogprobs,
    TrainSequence,
    collate,
    micro_batches,
    token_logprobs,
)


@dataclass
class LossSettings:
    loss: str
    clip_epsilon: float
    kl_coef: float
    temperature: float
    token_budget: int  # dr_grpo's constant normaliser: max_tokens_per_rollout
    importance_cap: float | None = None  # truncated importance sampling's cap; None: off


@dataclass
class UpdateStats:
    loss: float = 0.0
    kl: float | None = None
    grad_norm: float = 0.0
    sampled_tokens: int = 0
    # Sampler vs trainer: mean |log p_train - log p_sampled| over the sampled tokens (numerical
    # mismatch, larger in bfloat16), and the share of those tokens the clip takes the gradient from.
    logprob_mismatch: float | None = None
    clip_fraction: float | None = None
    # Truncated importance sampling (importance_cap): the share of sampled tokens whose weight
    # p_trainer / p_sampler the cap cut, i.e. where the sampler (another engine, or an older policy
    # version) differs most.
    importance_clip_fraction: float | None = None
    # Where the update's time went (the step-time breakdown): forward passes (policy and reference,
    # with the loss), backward passes; the rest of the update (optimizer, collation) is the difference.
    forward_s: float = 0.0
    backward_s: float = 0.0

    @classmethod
    def merged(cls, shares: Sequence[UpdateStats]) -> UpdateStats:
        """The statistics of one data-parallel step from each process's: sums for the loss (each
        share is already divided by the step's sequence count) and the tokens, token-weighted
        means, the shared gradient norm, and the slowest process's times."""
        tokens = sum(s.sampled_tokens for s in shares)

        def mean(name: str) -> float | None:
            parts = [(getattr(s, name), s.sampled_tokens) for s in shares if getattr(s, name) is not None]
            weight = sum(n for _, n in parts)
            return sum(v * n for v, n in parts) / weight if weight else None

        return cls(sum(s.loss for s in shares), mean("kl"), shares[0].grad_norm, tokens, mean("logprob_mismatch"),
                   mean("clip_fraction"), mean("importance_clip_fraction"), max(s.forward_s for s in shares),
                   max(s.backward_s for s in shares))


class UpdateAccumulator:
    """The statistics of one update, summed micro-batch by micro-batch, so that the update's
    loop holds only the math."""

    def __init__(self, clip_epsilon: float, importance_cap: float | None = None) -> None:
        self.clip_epsilon, self.importance_cap = clip_epsilon, importance_cap
        self.loss = self.kl_sum = self.mismatch = self.forward_s = self.backward_s = 0.0
        self.kl_tokens = self.sampled = self.clipped = self.capped = 0

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the block's seconds to `forward_s` or `backward_s`."""
        started = time.perf_counter()
        yield
        setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + time.perf_counter() - started)

    def add(self, batch: Collated, new_logprobs: torch.Tensor, loss: torch.Tensor, kl: torch.Tensor | None) -> None:
        mask = batch.loss_mask
        self.loss += loss.item()
        self.sampled += int(mask.sum())
        delta = (new_logprobs.detach() - batch.sampling_logprobs)[mask]
        self.mismatch += float(delta.abs().sum())
        self.clipped += clipped_tokens(delta.exp(), batch.advantages.expand_as(mask)[mask], self.clip_epsilon)
        if self.importance_cap is not None:
            self.capped += int((delta.exp() > self.importance_cap).sum())
        if kl is not None:
            self.kl_sum += float(kl.detach()[mask].sum())
            self.kl_tokens += int(mask.sum())

    def result(self, grad_norm: float) -> UpdateStats:
        per_token = (lambda total: total / self.sampled) if self.sampled else (lambda _total: None)
        return UpdateStats(self.loss, self.kl_sum / self.kl_tokens if self.kl_tokens else None, grad_norm,
                           self.sampled, per_token(self.mismatch), per_token(self.clipped),
                           per_token(self.capped) if self.importance_cap is not None else None, self.forward_s,
                           self.backward_s)


def micro_batch_loss(new_logprobs: torch.Tensor, batch: Collated, settings: LossSettings, n_sequences: int,
                     reference_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This micro-batch's share of the step's loss (the mean over all `n_sequences` used
    sequences of their per-sequence losses), and the per-token KL when a reference is given.
    Positions outside the loss mask contribute exactly nothing."""
    mask = batch.loss_mask
    # Outside the mask the ratio is pinned to 1 so padding can never make inf or NaN.
    sampled = torch.where(mask, batch.sampling_logprobs, new_logprobs.detach())
    if settings.importance_cap is None:
        per_token = -clipped_token_objective(new_logprobs, sampled, batch.advantages, settings.clip_epsilon)
    else:
        # Truncated importance sampling: the ratio against the policy being trained (its log-probs
        # before this step), each token weighted by min(p_trainer / p_sampler, cap) for what the
        # sampler computed differently (another engine or precision), not a clip that binds on it.
        trained = new_logprobs.detach()
        weight = torch.exp(trained - sampled).clamp(max=settings.importance_cap)
        per_token = -clipped_token_objective(new_logprobs, trained, batch.advantages, settings.clip_epsilon) * weight
    kl = None
    if reference_logprobs is not None:
        kl = k3_kl(new_logprobs, torch.where(mask, reference_logprobs, new_logprobs.detach()))
        per_token = per_token + settings.kl_coef * kl
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    normaliser = sequence_normaliser(settings.loss, mask.sum(dim=-1).float(), settings.token_budget)
    return (per_token.sum(dim=-1) / normaliser).sum() / n_sequences, kl


def train_sequences(graded: Sequence[GradedRollout], group_size: int, loss: str) -> tuple[list[TrainSequence], int]:
    """Group-relative advantages per prompt (each run of `group_size` rollouts), set on the
    rollouts; returns the sequences to train on and the number of groups skipped for lack of
    reward spread (their rollouts get advantage 0)."""
    sequences, zero_spread = [], 0
    for start in range(0, len(graded), group_size):
        usable = [g for g in graded[start:start + group_size] if g.reward is not None]
        advantages = group_advantages([g.reward for g in usable], loss)
        if advantages is None:
            zero_spread += 1
            for rollout in usable:
                rollout.advantage = 0.0
            continue
        for rollout, advantage in zip(usable, advantages):
            rollout.advantage = advantage
            sequences.append(TrainSequence.from_record(rollout.record, advantage))
    return sequences, zero_spread


def groups_with_spread(graded: Sequence[GradedRollout], group_size: int) -> int:
    """How many groups (each run of `group_size` rollouts) have a reward spread: those the update learns from."""
    return sum(1 for start in range(0, len(graded), group_size)
               if has_reward_spread([g.reward for g in graded[start:start + group_size] if g.reward is not None]))


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: list[TrainSequence], *,
                  settings: LossSettings, pad_token_id: int, micro_batch_tokens: int, max_grad_norm: float,
                  reference: ReferenceLogprobs, n_sequences: int | None = None,
                  sync_gradients: Callable[[list[torch.nn.Parameter]], None] | None = None) -> UpdateStats:
    """One optimizer step over every sequence, micro-batch by micro-batch, gradients accumulated
    (blocking). `reference` gives the reference policy's log-probs of a batch, or None without KL.
    Data-parallel: `sequences` is this process's share of the step's `n_sequences`, and
    `sync_gradients` sums the gradients over the processes before the step, so that every process
    takes the step one process would take on all of them."""
    n_sequences = len(sequences) if n_sequences is None else n_sequences
    if not n_sequences:
        return UpdateStats()
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    stats = UpdateAccumulator(settings.clip_epsilon, settings.importance_cap)
    optimizer.zero_grad(set_to_none=True)
    for group in micro_batches(sequences, micro_batch_tokens):
        batch = collate(group, pad_token_id, device)
        with stats.timed("forward"):
            reference_logprobs = reference(batch)
            new_logprobs = token_logprobs(model, batch, settings.temperature)
            loss, kl = micro_batch_loss(new_logprobs, batch, settings, n_sequences, reference_logprobs)
        with stats.timed("backward"):
            loss.backward()
        stats.add(batch, new_logprobs, loss, kl)
    if sync_gradients is not None:
        sync_gradients(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()  # activations and gradients of this update's shapes
    return stats.result(float(grad_norm))
