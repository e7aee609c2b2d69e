"""The policy-gradient update: rollouts as the loss sees them (the exact sampled ids and their
sampling log-probs), group-relative advantages, micro-batches sorted by length (a group's
shared prompt fed once when that spares enough), the trainer's log-probs of the sampled tokens,
the clipped objective with optional k3 KL, and one optimizer step with its statistics.
The formulas are workers/rl/advantages.py; docs/training.md explains them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workers.rl.advantages import (
    clipped_token_objective,
    clipped_tokens,
    group_advantages,
    k3_kl,
    sequence_normaliser,
)
from workers.rl.constraints import unpacked
from workers.rl.grading import GradedRollout
from workers.rl.models import adapters_in_model_dtype, fused_rms_norms, fused_rotary, release_freed_memory
from workers.rl.rollout import RolloutRecord

@dataclass
class TrainSequence:
    """One rollout as the loss sees it: the exact sampled token ids and their sampling log-probs."""

    token_ids: list[int]
    loss_mask: list[int]
    sampling_logprobs: list[float]
    advantage: float
    # Sampled under a response_format: the tokens allowed at each constrained token (by index, packed
    # bits); the log-probs there are of the masked distribution, the one the sampler drew from.
    allowed: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: RolloutRecord, advantage: float) -> TrainSequence:
        return cls(list(record.token_ids), list(record.loss_mask), list(record.logprobs), advantage,
                   dict(record.allowed))


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
                   mean("clip_fraction"), max(s.forward_s for s in shares), max(s.backward_s for s in shares))


class UpdateAccumulator:
    """The statistics of one update, summed micro-batch by micro-batch, so that the update's
    loop holds only the math."""

    def __init__(self, clip_epsilon: float) -> None:
        self.clip_epsilon = clip_epsilon
        self.loss = self.kl_sum = self.mismatch = self.forward_s = self.backward_s = 0.0
        self.kl_tokens = self.sampled = self.clipped = 0

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
        if kl is not None:
            self.kl_sum += float(kl.detach()[mask].sum())
            self.kl_tokens += int(mask.sum())

    def result(self, grad_norm: float) -> UpdateStats:
        per_token = (lambda total: total / self.sampled) if self.sampled else (lambda _total: None)
        return UpdateStats(self.loss, self.kl_sum / self.kl_tokens if self.kl_tokens else None, grad_norm,
                           self.sampled, per_token(self.mismatch), per_token(self.clipped), self.forward_s,
                           self.backward_s)


def micro_batches(sequences: list[TrainSequence], max_tokens: int, *, by_length: bool = True,
                  by_prompt: bool = True) -> list[list[TrainSequence]]:
    """Groups whose cost stays within `max_tokens`; a sequence costing more than that is a
    micro-batch of its own. With `by_prompt`, the rollouts of one prompt (the same tokens before
    their first sampled one) whose prompt is most of their tokens (`feedable_prefix`) are grouped
    together and their shared prompt counts once (`collate` feeds it once): cost = prompt + rows x
    longest rest. Within a prompt, or over all other sequences, rows are sorted by length, so a
    group's rows have similar lengths and little padding (in arrival order, 5-33 % of a demo step's
    tokens were padding; `by_length=False` keeps that order, the baseline of benchmarks/engine).
    The loss is a mean over all the step's sequences, so the grouping changes only float rounding,
    not the update."""
    if not by_prompt:
        return _chunks(sequences, max_tokens, by_length=by_length, shared=False)
    buckets: dict[tuple[int, ...], list[TrainSequence]] = {}
    for sequence in sequences:
        buckets.setdefault(_prompt_of(sequence), []).append(sequence)
    prompts, alone = [], []
    for bucket in buckets.values():
        if feedable_prefix(bucket):
            prompts.append(bucket)
        else:
            alone.extend(bucket)
    return [batch for bucket in [*prompts, alone]
            for batch in _chunks(bucket, max_tokens, by_length=by_length, shared=True)]


def _chunks(sequences: list[TrainSequence], max_tokens: int, *, by_length: bool, shared: bool
            ) -> list[list[TrainSequence]]:
    batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for sequence in sorted(sequences, key=lambda s: len(s.token_ids)) if by_length else sequences:
        if current and padded_cost([*current, sequence], shared=shared) > max_tokens:
            batches.append(current)
            current = []
        current.append(sequence)
    if current:
        batches.append(current)
    return batches


def _prompt_of(sequence: TrainSequence) -> tuple[int, ...]:
    return tuple(sequence.token_ids[:_first_sampled(sequence)])


def _first_sampled(sequence: TrainSequence) -> int:
    return next((i for i, flag in enumerate(sequence.loss_mask) if flag), len(sequence.loss_mask))


def shared_prefix_length(sequences: list[TrainSequence]) -> int:
    """Tokens every row starts with that can be fed once for all of them: the common prefix, short
    of each row's first sampled token and the position that predicts it (computed with the rest)."""
    if len(sequences) < 2:
        return 0
    limit = min(_first_sampled(s) for s in sequences) - 1
    first = sequences[0].token_ids
    length = 0
    while length < limit and all(len(s.token_ids) > length and s.token_ids[length] == first[length] for s in sequences):
        length += 1
    return length


def feedable_prefix(sequences: list[TrainSequence]) -> int:
    """The shared prefix `collate` feeds once, or 0. Its own forward, and a micro-batch per prompt,
    pay off when feeding it once spares at least SHARE_WHEN_SPARED of the rows' tokens: at 53 %
    spared (a 372-token prompt, 4 rollouts) the update took 0.75x the time, at 28 % (the demo's
    93-token prompt) 1.17x, in smaller micro-batches (benchmarks/engine)."""
    prefix = shared_prefix_length(sequences)
    spared = prefix * (len(sequences) - 1)
    return prefix if spared and spared >= SHARE_WHEN_SPARED * sum(len(s.token_ids) for s in sequences) else 0


SHARE_WHEN_SPARED = 0.4


def padded_cost(group: list[TrainSequence], *, shared: bool) -> int:
    prefix = feedable_prefix(group) if shared else 0
    return prefix + len(group) * (max(len(s.token_ids) for s in group) - prefix)


@dataclass
class Collated:
    input_ids: torch.Tensor  # [B, L], right-padded: each row's tokens after the shared prefix
    attention_mask: torch.Tensor  # [B, prefix + L]
    positions: torch.Tensor  # [P]: positions of input_ids whose logits predict a sampled token of some row
    loss_mask: torch.Tensor  # [B, P]: 1 where position+1 is a sampled token of that row
    sampling_logprobs: torch.Tensor  # [B, P]
    advantages: torch.Tensor  # [B, 1]
    prefix_ids: torch.Tensor | None = None  # [1, prefix]: the tokens every row starts with, fed once
    # [N, W] for the N sampled positions (loss_mask's nonzero order): the tokens a response_format
    # allowed there (all where none applied; W: the tokenizer's vocabulary, in whole 32-bit words),
    # and [N] which positions it constrained; None when no row was constrained.
    allowed: torch.Tensor | None = None
    constrained: torch.Tensor | None = None


# The reference policy's log-probs of a batch's tokens (None: no KL term).
ReferenceLogprobs = Callable[["Collated"], torch.Tensor | None]


def collate(sequences: list[TrainSequence], pad_token_id: int, device: torch.device, *,
            share_prefix: bool = True) -> Collated:
    """The micro-batch as tensors. With `share_prefix`, the tokens all rows start with (a group's
    prompt, `feedable_prefix`) become `prefix_ids`, fed once; the rows hold the rest."""
    prefix = feedable_prefix(sequences) if share_prefix else 0
    width = max(len(s.token_ids) for s in sequences) - prefix
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), prefix + width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    sampled = torch.zeros((len(sequences), width), dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        n = len(sequence.token_ids) - prefix
        ids[row, :n] = torch.tensor(sequence.token_ids[prefix:])
        attention[row, :prefix + n] = 1
        mask[row, :n] = torch.tensor(sequence.loss_mask[prefix:], dtype=torch.bool)
        sampled[row, :n] = torch.tensor(sequence.sampling_logprobs[prefix:], dtype=torch.float32)
    mask[:, 0] = False  # no context in the rows to predict it from (with a prefix it is never sampled)
    # Only the logits that predict a sampled token are computed: the vocabulary projection of
    # prompt and tool-output positions is skipped, which is most of the memory for long contexts.
    targets = torch.nonzero(mask.any(dim=0)).squeeze(-1)
    loss_mask = mask[:, targets]
    return Collated(
        input_ids=ids.to(device), attention_mask=attention.to(device), positions=(targets - 1).to(device),
        loss_mask=loss_mask.to(device), sampling_logprobs=sampled[:, targets].to(device),
        advantages=torch.tensor([[s.advantage] for s in sequences], dtype=torch.float32, device=device),
        prefix_ids=torch.tensor([sequences[0].token_ids[:prefix]], device=device) if prefix else None,
        **_allowed(sequences, loss_mask, targets + prefix, device),
    )


def _allowed(sequences: list[TrainSequence], loss_mask: torch.Tensor, token_index: torch.Tensor,
             device: torch.device) -> dict[str, torch.Tensor]:
    """Collated's `allowed` and `constrained`: the response_format masks of the sampled positions,
    unpacked; none when no position was constrained."""
    rows, columns = loss_mask.nonzero(as_tuple=True)
    packed = [sequences[row].allowed.get(int(token_index[column])) if sequences[row].allowed else None
              for row, column in zip(rows.tolist(), columns.tolist())]
    if all(mask is None for mask in packed):
        return {}
    width = max(m.size for m in packed if m is not None) * 8
    bits = np.ones((len(packed), width), dtype=bool)
    for n, mask in enumerate(packed):
        if mask is not None:
            bits[n] = unpacked(mask, width)
    constrained = torch.tensor([mask is not None for mask in packed], device=device)
    return {"allowed": torch.from_numpy(bits).to(device), "constrained": constrained}


def token_logprobs(model: torch.nn.Module, batch: Collated, temperature: float) -> torch.Tensor:
    """Log-probs [B, P] of the token at each position+1 where the loss mask is set (0 elsewhere),
    at the sampling temperature (as generation.sequence_logprobs computes them), over the full
    vocabulary."""
    logits, targets, (rows, columns) = target_logits(model, batch)
    if batch.allowed is not None:  # sampled under a response_format: its masked distribution
        logits = logits.masked_fill(~_fit(batch.allowed, batch.constrained, logits.shape[-1]), float("-inf"))
    if temperature > 0 and temperature != 1.0:  # x / 1 is x: spares a [positions, vocabulary] op and its backward
        logits = logits / temperature
    sampled = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.zeros(batch.loss_mask.shape, dtype=sampled.dtype, device=sampled.device).index_put((rows, columns),
                                                                                                     sampled)


def _fit(allowed: torch.Tensor, constrained: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """The masks over the model's vocabulary, which may be wider than the tokenizer's: a constrained
    position never allows the ids past the tokenizer's (the sampler's mask did not), others allow all."""
    if allowed.shape[-1] >= vocabulary:
        return allowed[:, :vocabulary]
    beyond = (~constrained).unsqueeze(-1).expand(-1, vocabulary - allowed.shape[-1])
    return torch.cat([allowed, beyond], dim=-1)


def target_logits(model: torch.nn.Module, batch: Collated) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The float logits [N, V] at the N positions whose next token is in the loss mask, those
    next tokens [N], and where they sit in the mask (rows, columns). A shared prefix runs once,
    its keys and values repeated for every row (the gradient flows back through them). The
    vocabulary projection, the largest tensor of an update, runs only on those positions: a row's
    prompt and tool-output positions, and the positions only other rows of the micro-batch
    sample at, are skipped."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA: the wrapped model
    rows, columns = batch.loss_mask.nonzero(as_tuple=True)
    positions = batch.positions[columns]
    decoder = causal_lm.get_decoder()
    with adapters_in_model_dtype(model), fused_rms_norms(model), fused_rotary(model):
        prefix = None
        if batch.prefix_ids is not None:  # fed once; every row attends to (and backpropagates into) it
            prefix = decoder(input_ids=batch.prefix_ids, use_cache=True).cache
            prefix.batch_repeat_interleave(batch.input_ids.shape[0])
        # Rows are right-padded: under the causal mask alone no token of a row sees its padding, so
        # without a prefix the padding mask changes no log-prob and no gradient, and attention runs
        # causal (blocks above the diagonal skipped; in bf16 on a CPU, workers.rl.training_attention).
        mask = batch.attention_mask if prefix is not None else None
        hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, cache=prefix,
                         use_cache=prefix is not None).last_hidden_state
        logits = causal_lm.get_output_embeddings()(hidden[rows, positions]).float()
    return logits, batch.input_ids[rows, positions + 1], (rows, columns)


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
    stats = UpdateAccumulator(settings.clip_epsilon)
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
