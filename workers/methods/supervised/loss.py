"""The supervised step: token-level cross-entropy on the loss-masked tokens (the mean over every
such token of the step), accumulated micro-batch by micro-batch, one optimizer step; and the same
loss and token accuracy without gradients, for validation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.models.loading import release_freed_memory
from workers.training.sequences import TrainSequence, collate, micro_batches, target_logits


@dataclass
class TokenScores:
    loss: float | None = None  # mean negative log-likelihood per learned token
    accuracy: float | None = None  # share of learned tokens that are the model's most likely next token
    tokens: int = 0  # learned tokens
    grad_norm: float | None = None

    @classmethod
    def merged(cls, shares: Sequence[TokenScores]) -> TokenScores:
        """One data-parallel step's scores from each process's (each a share of the step's means)."""
        scored = [s for s in shares if s.tokens]
        if not scored:
            return TokenScores(grad_norm=shares[0].grad_norm)
        return TokenScores(sum(s.loss for s in scored), sum(s.accuracy for s in scored), sum(s.tokens for s in scored),
                           shares[0].grad_norm)


def learned_tokens(sequences: list[TrainSequence]) -> int:
    """Tokens with loss (a row's first token is never predicted)."""
    return sum(sum(s.loss_mask[1:]) for s in sequences)


def supervised_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: list[TrainSequence], *,
                      pad_token_id: int, micro_batch_tokens: int, max_grad_norm: float, step_tokens: int | None = None,
                      sync_gradients: Callable[[list[torch.nn.Parameter]], None] | None = None) -> TokenScores:
    """One optimizer step over `sequences` (blocking); the scores are those of the weights before it.
    Data-parallel: `sequences` is this process's share of a step of `step_tokens` learned tokens (the
    loss's denominator), and `sync_gradients` sums the gradients over the processes before the step."""
    total = learned_tokens(sequences) if step_tokens is None else step_tokens
    if not total:
        return TokenScores()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    nll = correct = 0.0
    for batch in _batches(sequences, pad_token_id, micro_batch_tokens, params[0].device):
        logits, targets, _ = target_logits(model, batch)
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        (losses.sum() / total).backward()
        nll += float(losses.detach().sum())
        correct += float((logits.detach().argmax(dim=-1) == targets).sum())
    if sync_gradients is not None:
        sync_gradients(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    return TokenScores(nll / total, correct / total, learned_tokens(sequences), float(grad_norm))


@torch.no_grad()
def score(model: torch.nn.Module, sequences: list[TrainSequence], *, pad_token_id: int,
          micro_batch_tokens: int) -> TokenScores:
    """Loss and token accuracy of `sequences` under the current weights."""
    total = learned_tokens(sequences)
    if not total:
        return TokenScores()
    device = next(model.parameters()).device
    nll = correct = 0.0
    for batch in _batches(sequences, pad_token_id, micro_batch_tokens, device):
        logits, targets, _ = target_logits(model, batch)
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        correct += float((logits.argmax(dim=-1) == targets).sum())
    return TokenScores(nll / total, correct / total, total)


def _batches(sequences: list[TrainSequence], pad_token_id: int, micro_batch_tokens: int, device: torch.device):  # noqa: ANN202
    # Rows of a supervised batch rarely share a prompt worth feeding once: no shared prefix.
    for group in micro_batches(sequences, micro_batch_tokens, by_prompt=False):
        yield collate(group, pad_token_id, device, share_prefix=False)
