"""Causal self-attention for the update, with a backward pass built from large matmuls.

torch's CPU flash attention computes the update's attention forward well, but its backward ran
~5x the forward: a third of a LoRA update of SmolLM2-135M at the demo's shapes (4-7 rows of
230-490 tokens), in small blocked matmuls (benchmarks/engine). Here the forward is that same flash
kernel (its output and log-sum-exp are kept), and the backward recomputes what it needs in a few
large matmuls, query heads stacked per KV head (no copies of K and V per query head):

- the scores S = q k^T in float32 (the softmax's exponent needs them exactly: recomputed in
  bfloat16 they moved the gradients by ~2 %), dP = dO v^T in bfloat16;
- P = exp(S * scale - lse) on and below the diagonal and dS = P * (dP - rowsum(dO * out)) * scale,
  in one pass on our kernel (kernels/attention_backward.cpp), rounded to bfloat16;
- dv = P^T dO, dq = dS k, dk = dS^T q in bfloat16 (float32 accumulation).

Against float64 its gradients are as close as flash's own (tests/rl/test_training_attention.py).
It applies where the update calls attention: bfloat16 on the CPU, gradients recorded, causal with
no mask (the update's rows are right-padded, so the causal mask is the whole mask), queries as
long as the keys, a score matrix within MAX_SCORES; elsewhere the caller runs sdpa.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.models.cpu import cpu_kernels


# The backward holds the whole [batch, heads, queries, keys] score matrix (float32, and three bf16
# copies: ~10 bytes an entry); past this many entries (~670 MB) it leaves the call to flash, which
# works in blocks. The default micro-batch (2048 tokens, 9 heads) stays under it at any row length.
MAX_SCORES = 2**26


def applies(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> bool:
    """Whether `causal_attention` computes this call: see the module's docstring."""
    batch, heads, length, _ = query.shape
    return (torch.is_grad_enabled() and query.requires_grad and attention_mask is None
            and query.device.type == "cpu" and query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16
            and length == key.shape[2] > 1 and heads % key.shape[1] == 0 and batch * heads * length * length <= MAX_SCORES
            and not kwargs.get("dropout") and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
            and cpu_kernels.load() is not None)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v for query [batch, heads, length, dim] and key, value
    [batch, kv heads, length, dim]; output [batch, heads, length, dim]."""
    return _CausalAttention.apply(query, key, value, scale)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        group = query.shape[1] // key.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1), is_causal=True,
            scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        query, key, value, out, lse = ctx.saved_tensors
        batch, heads, length, dim = query.shape
        kv_heads = key.shape[1]
        stacked = (batch, kv_heads, heads // kv_heads * length, dim)  # query head h reads KV head h // group
        q, d_out = query.contiguous().view(stacked), grad_out.contiguous().view(stacked)
        scores = torch.matmul(q.float(), key.float().transpose(-1, -2))
        d_probs = torch.matmul(d_out, value.transpose(-1, -2))
        delta = (grad_out.float() * out.float()).sum(-1)
        probs, d_scores = cpu_kernels.load().causal_softmax_backward(
            scores.view(-1, stacked[2], length), d_probs.view(-1, stacked[2], length),
            lse.float().contiguous().view(-1, stacked[2]), delta.contiguous().view(-1, stacked[2]), ctx.scale, length)
        probs, d_scores = probs.view(scores.shape), d_scores.view(scores.shape)
        d_value = torch.matmul(probs.transpose(-1, -2), d_out)
        d_query = torch.matmul(d_scores, key).view(batch, heads, length, dim)
        d_key = torch.matmul(d_scores.transpose(-1, -2), q)
        return d_query, d_key, d_value, None
