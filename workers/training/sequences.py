"""Training sequences as every method's loss sees them: the token ids, which of them carry loss,
and (for sampled rollouts) their sampling log-probs; micro-batches sorted by length (a shared
prompt fed once when that spares enough); their collation into tensors; and the trainer's logits
and log-probs of the trained tokens, computed only where a token is trained."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from workers.engine.constraints import unpacked
from workers.engine.rollout import RolloutRecord
from workers.models.cpu.cpu_speedups import training_forward

T = TypeVar("T")


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
        return chunked(sequences, max_tokens, rows=_alone, by_length=by_length, shared=False)
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
            for batch in chunked(bucket, max_tokens, rows=_alone, by_length=by_length, shared=True)]


def chunked(items: list[T], max_tokens: int, *, rows: Callable[[T], list[TrainSequence]], by_length: bool = True,
            shared: bool) -> list[list[T]]:
    """`items` in runs whose rows (`rows(item)`: a sequence, or both answers of a pair) cost at most
    `max_tokens` padded tokens together (`padded_cost`); an item costing more is a run of its own.
    With `by_length`, items are taken shortest first, so a run's rows pad little."""
    ordered = sorted(items, key=lambda item: sum(len(s.token_ids) for s in rows(item))) if by_length else items
    batches: list[list[T]] = []
    current: list[T] = []
    for item in ordered:
        if current and padded_cost([row for i in (*current, item) for row in rows(i)], shared=shared) > max_tokens:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches


def _alone(sequence: TrainSequence) -> list[TrainSequence]:
    return [sequence]


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
    with training_forward(model):
        prefix = None
        if batch.prefix_ids is not None:  # fed once; every row attends to (and backpropagates into) it
            prefix = decoder(input_ids=batch.prefix_ids, use_cache=True).cache
            prefix.batch_repeat_interleave(batch.input_ids.shape[0])
        # Rows are right-padded: under the causal mask alone no token of a row sees its padding, so
        # without a prefix the padding mask changes no log-prob and no gradient, and attention runs
        # causal (blocks above the diagonal skipped; in bf16 on a CPU, workers.models.cpu.training_attention).
        mask = batch.attention_mask if prefix is not None else None
        hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, cache=prefix,
                         use_cache=prefix is not None).last_hidden_state
        logits = causal_lm.get_output_embeddings()(hidden[rows, positions]).float()
    return logits, batch.input_ids[rows, positions + 1], (rows, columns)
