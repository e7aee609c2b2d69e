"""THE BASELINE of benchmarks/engine, frozen: generate_batch as it was before continuous batching
(commit 853212f), measured side by side with workers/engine/generation.py, and the update's forward of
that commit (`token_logprobs`), against workers/methods/reinforcement/trainer.py. Not used by the product.

Batched sampling with a KV cache, left padding, per-rollout seeds, and the log-prob of every
sampled token (token-in/token-out: the ids and log-probs are kept exactly as sampled).

Log-probs are those of the policy at the sampling temperature over the full vocabulary
(top-p only narrows which token is drawn), so the trainer can recompute them with one
forward pass and the same temperature.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationRequest:
    context_ids: list[int]
    max_new_tokens: int
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()  # e.g. "</tool_call>": checked on the decoded tail


@dataclass
class GenerationOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"  # "stop" (an end-of-turn token was sampled) or "length"


def _sample_rows(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row, and its log-prob under the tempered policy. Vectorised over rows; each
    row draws its single uniform number from its own generator (inverse-CDF sampling), so a
    rollout's tokens depend on its seed only, never on which rollouts share its batch."""
    logits = logits.float()
    if temperature <= 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1)
    else:
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        probs, order = logprobs.exp(), None
        if top_p < 1.0:
            probs, order = torch.sort(probs, dim=-1, descending=True)
            probs = probs * ((probs.cumsum(dim=-1) - probs) < top_p)
        cdf = probs.cumsum(dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=g) for g in generators]).unsqueeze(-1)
        picks = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1)
        tokens = (order.gather(-1, picks) if order is not None else picks).squeeze(-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


STOP_STRING_WINDOW = 8  # tokens decoded to look for a stop string


def _ends_with_stop_string(ids: list[int], stop_strings: tuple[str, ...], decode: Callable[[list[int]], str] | None) -> bool:
    if not stop_strings or decode is None:
        return False
    tail = decode(ids[-STOP_STRING_WINDOW:])
    return any(stop in tail for stop in stop_strings)


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module, requests: list[GenerationRequest], *, pad_token_id: int, temperature: float = 1.0,
    top_p: float = 1.0, decode: Callable[[list[int]], str] | None = None,
    on_token: Callable[[int, int], None] | None = None, timings: dict[str, float] | None = None,
) -> list[GenerationOutput]:
    """Generate for every request at once: left-padded contexts, one forward per new token.
    `on_token(row, token_id)` is called for each sampled token as it is drawn (streaming);
    `timings` gets the seconds of the prefill (the first forward and its sampling) and of the
    decode steps added to its "prefill_s" and "decode_s" (the step-time breakdown)."""
    device = next(model.parameters()).device
    width = max(len(r.context_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        ids[row, width - len(request.context_ids):] = torch.tensor(request.context_ids)
        mask[row, width - len(request.context_ids):] = 1
    ids, mask = ids.to(device), mask.to(device)
    generators = [torch.Generator().manual_seed(r.seed) for r in requests]
    outputs = [GenerationOutput() for _ in requests]
    active = [True] * len(requests)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past = None
    step_input, step_positions = ids, positions
    clock = _PhaseClock(timings, "prefill_s")
    for index in range(max(r.max_new_tokens for r in requests)):
        if index == 1:
            clock.switch("decode_s")  # the first forward is the prompt's; every later one adds a token
        result = model(input_ids=step_input, attention_mask=mask, position_ids=step_positions,
                       cache=past, use_cache=True, logits_to_keep=1)
        past = result.cache
        rows = [row for row, is_active in enumerate(active) if is_active]
        tokens, logprobs = _sample_rows(result.logits[rows, -1, :].cpu(), temperature, top_p,
                                        [generators[row] for row in rows])
        next_tokens = [pad_token_id] * len(requests)
        for row, token, logprob in zip(rows, tokens, logprobs):
            request, out = requests[row], outputs[row]
            out.token_ids.append(token)
            out.logprobs.append(logprob)
            next_tokens[row] = token
            if on_token is not None:
                on_token(row, token)
            if token in request.stop_token_ids or _ends_with_stop_string(out.token_ids, request.stop_strings, decode):
                out.finish, active[row] = "stop", False
            elif len(out.token_ids) >= request.max_new_tokens:
                active[row] = False
        if not any(active):
            break
        step_input = torch.tensor(next_tokens, device=device).unsqueeze(-1)
        # Finished rows keep a column (the cache is rectangular) but attend to nothing new.
        new_mask = torch.tensor([[1 if a else 0] for a in active], device=device, dtype=torch.long)
        mask = torch.cat([mask, new_mask], dim=-1)
        step_positions = step_positions[:, -1:] + 1
    clock.switch(None)
    return outputs


class _PhaseClock:
    """Adds the seconds spent in each phase to `timings[phase]`; does nothing without `timings`."""

    def __init__(self, timings: dict[str, float] | None, phase: str) -> None:
        self.timings, self.phase, self.started = timings, phase, time.perf_counter()

    def switch(self, phase: str | None) -> None:
        if self.timings is not None and self.phase is not None:
            now = time.perf_counter()
            self.timings[self.phase] = self.timings.get(self.phase, 0.0) + now - self.started
            self.started = now
        self.phase = phase


@torch.inference_mode()
def sequence_logprobs(model: torch.nn.Module, token_ids: list[int], *, temperature: float = 1.0) -> list[float]:
    """Log-prob of each token given the ones before it (index 0 gets 0.0): the trainer's view."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids).logits[0, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return [0.0] + logprobs.cpu().tolist()


def token_logprobs(model: torch.nn.Module, batch: Any, temperature: float) -> torch.Tensor:
    """The update's forward as it was before the engine's speed-ups (commit 853212f, workers/methods/reinforcement/trainer.py): the
    vocabulary projection and log-softmax on every position any row of the micro-batch samples at,
    for every row, and LoRA adapters run in float32 (peft's cast of every activation)."""
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   logits_to_keep=batch.positions, use_cache=False)
    logits = output.logits.float()
    if temperature > 0:
        logits = logits / temperature
    targets = batch.input_ids[:, batch.positions + 1]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
