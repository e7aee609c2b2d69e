"""A decode step of a Llama-family model without transformers' module machinery.

At a decode step's 16 rows SmolLM2-135M's weights take ~15 ms to read, and transformers spent
about as long again around them: each of 30 layers goes through decorated forwards, keyword
plumbing, peft's LoRA wrapper (merged, so only a call through), the sibling projections'
hand-off, a causal mask built anew and a cache update per layer (benchmarks/engine). While
sampling (models.sampling_weights: LoRA merged, weights packed for oneDNN, our kernels built)
`LeanDecoder.step` runs the same ops on the same tensors in the same order, called directly:
embedding, then per layer RMSNorm, one q/k/v matmul, the rotary embedding (our kernel, with
transformers' roundings), the cache's append, our decode attention, o_proj, the residual, RMSNorm, one gate/up matmul, the
activation times up, down_proj, the residual; the final norm and the output layer. The logits
are bit-identical to the model's (tests/rl/test_lean_decode.py).

It is built only where each of those holds (a decoder layer of LEAN_LAYERS with every
projection packed, no sliding window, RMSNorm and attention on our kernels); elsewhere the
model runs as it is. Prefills run through the model: they are matmul-bound.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.models.cpu import cpu_kernels
from workers.models.cpu.cpu_speedups import LLAMA_RMS_NORMS, PackedWeight, packed_weight
from workers.models.loading import ATTENTION

# Decoder layers whose forward is exactly the step below (transformers' Llama; SmolLM2 is one).
LEAN_LAYERS = ("LlamaDecoderLayer",)

_decoders: weakref.WeakKeyDictionary[Any, LeanDecoder] = weakref.WeakKeyDictionary()


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: PackedWeight  # q, k and v stacked
    o: PackedWeight
    post_norm: torch.Tensor
    gate_up: PackedWeight  # gate and up stacked
    down: PackedWeight
    act: Callable[[torch.Tensor], torch.Tensor]


class LeanDecoder:
    """One decode step for every row at once (see the module's docstring)."""

    def __init__(self, base: Any, head: PackedWeight, layers: list[_Layer], kernels: Any) -> None:
        config = base.config
        self.kernels = kernels  # the built cpu_kernels module
        self.embed, self.rotary, self.final_norm, self.head = base.embed_tokens, base.rotary_emb, base.norm, head
        self.layers = layers
        self.eps = base.norm.variance_epsilon
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = base.layers[0].self_attn.scaling

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             cache: Any) -> torch.Tensor:
        """Logits [rows, vocab] of the next token, given each row's last token [rows, 1], the
        [rows, width + 1] mask of the cache's columns and this token, and its positions [rows, 1]."""
        rows = input_ids.shape[0]
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        # A one-token query comes after every cached column, so the causal mask is the padding
        # mask; with no padding transformers passes none (the same as all True in the kernel).
        keep = attention_mask.bool()
        mask = None if bool(keep.all()) else keep[:, None, None, :]
        v_start = (self.heads + self.kv_heads) * self.head_dim
        for index, layer in enumerate(self.layers):
            residual = hidden
            qkv = layer.qkv(self._norm(hidden, layer.input_norm))
            # transformers' rotary, its roundings kept (kernels/rotary.cpp); q packed per KV head
            packed, k = self.kernels.rotary(qkv, cos, sin, self.heads, self.kv_heads)
            v = qkv[..., v_start:].view(rows, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            keys, values = cache.update(k, v, index)
            attended = cpu_kernels.attend(packed, keys, values, mask, self.scale)
            hidden = residual + layer.o(attended.reshape(rows, 1, self.heads * self.head_dim))
            residual = hidden
            gate, up = layer.gate_up(self._norm(hidden, layer.post_norm)).split(layer.gate_up.sizes, dim=-1)
            hidden = residual + layer.down(layer.act(gate) * up)
        return self.head(self._norm(hidden, self.final_norm.weight))[:, -1, :]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, self.eps)


def build(model: Any) -> LeanDecoder | None:
    """A LeanDecoder over `model`'s packed weights, or None where its step would not be the
    model's own (see the module's docstring). Call inside models.sampling_weights."""
    base, kernels = _decoder_stack(model), cpu_kernels.load()
    if base is None or kernels is None or getattr(base.config, "_attn_implementation", "") != ATTENTION:
        return None
    head = packed_weight(model.get_output_embeddings())
    layers = [_lean_layer(layer) for layer in base.layers]
    if head is None or None in layers or type(base.norm).__name__ not in LLAMA_RMS_NORMS:
        return None
    if len(base.layers) != base.config.num_hidden_layers or getattr(base.config, "sliding_window", None):
        return None
    if next(base.parameters()).dtype != torch.bfloat16:  # what the rotary kernel rounds to
        return None
    return LeanDecoder(base, head, layers, kernels)


def register(model: Any, decoder: LeanDecoder | None) -> None:
    """Make `decoder` the one `decoder_for(model)` returns (None: forget it)."""
    if decoder is None:
        _decoders.pop(model, None)
    else:
        _decoders[model] = decoder


def decoder_for(model: Any) -> LeanDecoder | None:
    """The lean decoder registered for `model` (inside models.sampling_weights), if any."""
    return _decoders.get(model)


def _decoder_stack(model: Any) -> Any:
    """The module holding embed_tokens, layers, norm and rotary_emb (LlamaModel), through peft."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(inner, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb", "config")
    return base if base is not None and all(hasattr(base, name) for name in needed) else None


def _lean_layer(layer: Any) -> _Layer | None:
    if type(layer).__name__ not in LEAN_LAYERS or "forward" in layer.__dict__:
        return None
    attention, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = packed_weight(attention.q_proj), packed_weight(mlp.gate_proj)
    o, down = packed_weight(attention.o_proj), packed_weight(mlp.down_proj)
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    stacked = [_base(attention.q_proj), _base(attention.k_proj), _base(attention.v_proj)]
    if qkv.layers != stacked or gate_up.layers != [_base(mlp.gate_proj), _base(mlp.up_proj)]:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm).__name__ not in LLAMA_RMS_NORMS for norm in norms):
        return None
    return _Layer(norms[0].weight, qkv, o, norms[1].weight, gate_up, down, mlp.act_fn)


def _base(layer: Any) -> Any:
    return getattr(layer, "base_layer", layer)
