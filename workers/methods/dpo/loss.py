"""The DPO step (Rafailov et al., 2023): for a pair with preferred answer w and non-preferred l,

    loss = -log sigmoid(beta * ((log pi(w) - log ref(w)) - (log pi(l) - log ref(l))))

where log pi(y) sums the answer's token log-probs under the policy and ref is the starting model,
scored once before training (`reference_logprobs`): no second model is held or run during steps.
A micro-batch holds whole pairs, both answers in one forward pass (their shared conversation fed
once when that spares enough, as the reinforcement update does), and only the answer positions
go through the vocabulary projection. The step's loss is the mean over its pairs; several
training processes each take a share of the pairs and sum their gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.methods.dpo.data import Pair
from workers.models.loading import release_freed_memory
from workers.training.sequences import Collated, chunked, collate, target_logits


TIE_NATS = 1e-3  # log-ratio margins below this count as ties in the preference accuracy


@dataclass
class PairScores:
    """A set of pairs' DPO statistics: sums, so that shares of several processes add up; `means()`
    gives the per-pair values the metrics report."""

    pairs: int = 0
    loss: float = 0.0
    correct: int = 0  # pairs whose implicit reward prefers the preferred answer (strictly)
    chosen_reward: float = 0.0  # beta * (log pi(w) - log ref(w))
    rejected_reward: float = 0.0
    logprob_margin: float = 0.0  # log pi(w) - log pi(l): the policy's own preference
    learned_tokens: int = 0
    grad_norm: float | None = None

    def add(self, other: PairScores) -> PairScores:
        return PairScores(self.pairs + other.pairs, self.loss + other.loss, self.correct + other.correct,
                          self.chosen_reward + other.chosen_reward, self.rejected_reward + other.rejected_reward,
                          self.logprob_margin + other.logprob_margin, self.learned_tokens + other.learned_tokens,
                          self.grad_norm if self.grad_norm is not None else other.grad_norm)

    @classmethod
    def merged(cls, shares: Sequence[PairScores]) -> PairScores:
        total = PairScores()
        for share in shares:
            total = total.add(share)
        return total

    def means(self) -> dict[str, float | None]:
        n = self.pairs
        mean = (lambda total: total / n) if n else (lambda _total: None)
        chosen, rejected = mean(self.chosen_reward), mean(self.rejected_reward)
        return {"loss": mean(self.loss), "preference_accuracy": mean(self.correct),
                "reward_margin": None if chosen is None else chosen - rejected,
                "chosen_reward": chosen, "rejected_reward": rejected, "logprob_margin": mean(self.logprob_margin)}


def pair_batches(pairs: list[Pair], max_tokens: int) -> list[list[Pair]]:
    """Micro-batches of whole pairs within `max_tokens` padded tokens (a shared conversation
    counted once), pairs sorted by length so that a batch's rows pad little."""
    return chunked(pairs, max_tokens, rows=lambda pair: [pair.chosen, pair.rejected], shared=True)


def _rows(pairs: list[Pair]) -> list:
    return [sequence for pair in pairs for sequence in (pair.chosen, pair.rejected)]


def _answer_logprobs(model: torch.nn.Module, batch: Collated) -> tuple[torch.Tensor, int]:
    """Per row, the summed log-probs of its answer's tokens [B], and how many tokens those are."""
    logits, targets, (rows, _columns) = target_logits(model, batch)
    token = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    sums = torch.zeros(batch.input_ids.shape[0], dtype=token.dtype, device=token.device).index_add(0, rows, token)
    return sums, int(targets.numel())


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, pairs: list[Pair], *, pad_token_id: int, micro_batch_tokens: int) -> None:
    """Sets every pair's `reference`: its answers' log-probs under `model` as it is now."""
    for group in pair_batches(pairs, micro_batch_tokens):
        sums, _ = _answer_logprobs(model, _collated(group, pad_token_id, model))
        for pair, (chosen, rejected) in zip(group, sums.view(-1, 2).tolist()):
            pair.reference = (chosen, rejected)


def _collated(pairs: list[Pair], pad_token_id: int, model: torch.nn.Module) -> Collated:
    return collate(_rows(pairs), pad_token_id, next(model.parameters()).device)


def _pair_terms(sums: torch.Tensor, pairs: list[Pair], beta: float) -> tuple[torch.Tensor, PairScores]:
    """The pairs' losses [n] (with their graph) and their statistics."""
    reference = torch.tensor([p.reference for p in pairs], dtype=sums.dtype, device=sums.device)
    policy = sums.view(-1, 2)
    rewards = beta * (policy - reference)  # [n, (preferred, non-preferred)]
    losses = -torch.nn.functional.logsigmoid(rewards[:, 0] - rewards[:, 1])
    detached = rewards.detach()
    # A margin within float rounding is a tie, not a preference: the reference was scored in other
    # micro-batches, so at the starting weights the two differ by rounding alone.
    prefers = (detached[:, 0] - detached[:, 1]) > beta * TIE_NATS
    stats = PairScores(len(pairs), float(losses.detach().sum()), int(prefers.sum()),
                       float(detached[:, 0].sum()), float(detached[:, 1].sum()),
                       float((policy.detach()[:, 0] - policy.detach()[:, 1]).sum()))
    return losses, stats


def dpo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, pairs: list[Pair], *, beta: float,
               pad_token_id: int, micro_batch_tokens: int, max_grad_norm: float, n_pairs: int | None = None,
               sync_gradients: Callable[[list[torch.nn.Parameter]], None] | None = None) -> PairScores:
    """One optimizer step over `pairs` (blocking); the scores are those of the weights before it.
    Data-parallel: `pairs` is this process's share of the step's `n_pairs`, and `sync_gradients`
    sums the gradients over the processes before the step."""
    n_pairs = len(pairs) if n_pairs is None else n_pairs
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    scores = PairScores()
    for group in pair_batches(pairs, micro_batch_tokens):
        sums, tokens = _answer_logprobs(model, _collated(group, pad_token_id, model))
        losses, stats = _pair_terms(sums, group, beta)
        (losses.sum() / n_pairs).backward()
        scores = scores.add(stats)
        scores.learned_tokens += tokens
    if sync_gradients is not None:
        sync_gradients(params)
    scores.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    return scores


@torch.no_grad()
def score_pairs(model: torch.nn.Module, pairs: list[Pair], *, beta: float, pad_token_id: int,
                micro_batch_tokens: int) -> PairScores:
    """The pairs' DPO statistics under the current weights."""
    scores = PairScores()
    for group in pair_batches(pairs, micro_batch_tokens):
        sums, tokens = _answer_logprobs(model, _collated(group, pad_token_id, model))
        scores = scores.add(_pair_terms(sums, group, beta)[1])
        scores.learned_tokens += tokens
    return scores
