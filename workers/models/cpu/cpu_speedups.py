"""CPU speed-ups while sampling and training: fused RMSNorm and rotary kernels, linear weights
packed for oneDNN's bf16 kernels (and fed their siblings' input once), LoRA merged into the
weights for sampling, adapters cast to the model's dtype. Each is a context manager that puts
the model back as it was; none of the CPU ones applies on a GPU. Sampling applies them through
one call (`sampling_weights`), training through another (`training_forward`)."""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from typing import Any

from workers.models.loading import native_bf16_cpu, on_cpu

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Weights prepared for sampling: LoRA merged, linear layers packed for the CPU's matmul kernel,
# RMSNorm on our kernel


@contextmanager
def sampling_weights(model: Any) -> Iterator[dict[str, int]]:
    """What the rollout engine samples on: LoRA merged (merged_lora_weights), then, on a CPU, the
    CPU speed-ups (cpu_speedups). Yields the layer counts."""
    with merged_lora_weights(model) as merged, cpu_speedups(model) as speedups:
        yield {"merged_lora_layers": merged, **speedups}


@contextmanager
def training_forward(model: Any) -> Iterator[None]:
    """What the update's forward and backward run under, as one unit: LoRA adapters in the model's
    dtype (adapters_in_model_dtype) and, on a CPU, RMSNorm and rotary on our kernels
    (fused_rms_norms, fused_rotary, whose backward the kernels also give)."""
    with adapters_in_model_dtype(model), fused_rms_norms(model), fused_rotary(model):
        yield


@contextmanager
def cpu_speedups(model: Any) -> Iterator[dict[str, int]]:
    """The CPU speed-ups as one unit, for inference inside the block: every bfloat16 linear layer
    packed for oneDNN (packed_linear_weights), Llama's RMSNorm and rotary embedding in one op each
    on our kernels (fused_rms_norms, fused_rotary), and decode steps on those without
    transformers' modules where the model is one lean_decode takes (workers.models.cpu.lean_decode).
    Nothing is built or patched for a model that is not on the CPU (on_cpu). Yields the counts."""
    from workers.models.cpu import lean_decode

    if not on_cpu(model):
        yield {"packed_linear_layers": 0, "fused_rms_norms": 0, "fused_rotary_layers": 0, "lean_decode_layers": 0}
        return
    with packed_linear_weights(model) as packed, fused_rms_norms(model) as norms, fused_rotary(model) as rotary:
        decoder = lean_decode.build(model)
        lean_decode.register(model, decoder)
        try:
            yield {"packed_linear_layers": packed, "fused_rms_norms": norms, "fused_rotary_layers": rotary,
                   "lean_decode_layers": len(decoder.layers) if decoder else 0}
        finally:
            lean_decode.register(model, None)


# transformers' RMSNorm classes that compute LlamaRMSNorm's formula (weight * x / rms(x), the
# weight applied after rounding to the input's dtype); Gemma's (1 + weight) and others are left alone.
LLAMA_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


@contextmanager
def fused_rms_norms(model: Any) -> Iterator[int]:
    """Inside the block (inference only), each Llama-style RMSNorm of `model` runs as one op on our
    CPU kernel (workers.models.cpu.cpu_kernels.rms_norm) instead of transformers' eight: ~3 ms of a
    ~40 ms decode step at 16 rows for SmolLM2-135M (benchmarks/engine). Roundings are torch's; the
    variance may differ by an ulp, so about one bfloat16 value in 10^5 differs by one step. Inputs
    it does not take (CUDA, another dtype) run the module's own forward. Yields how many norms."""
    from workers.models.cpu import cpu_kernels

    norms = [module for module in model.modules()
             if type(module).__name__ in LLAMA_RMS_NORMS and "forward" not in module.__dict__]
    if not norms or not on_cpu(model) or cpu_kernels.load() is None:
        yield 0
        return
    try:
        for norm in norms:
            norm.forward = partial(_fused_rms_norm, norm)
        yield len(norms)
    finally:
        for norm in norms:
            norm.__dict__.pop("forward", None)


def _fused_rms_norm(norm: Any, x: Any) -> Any:
    from workers.models.cpu import cpu_kernels

    out = cpu_kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    return type(norm).forward(norm, x) if out is None else out


# transformers' decoder layers whose attention calls its module's apply_rotary_pos_emb with
# transformers' Llama formula (q * cos + rotate_half(q) * sin), the one kernels/rotary.cpp computes.
LLAMA_ROTARY_LAYERS = ("LlamaDecoderLayer",)

_rotary_lock = threading.Lock()
_rotary_patched: dict[Any, tuple[Callable[..., Any], int]] = {}  # modeling module: (its function, users)


@contextmanager
def fused_rotary(model: Any) -> Iterator[int]:
    """Inside the block, the rotary embedding of `model`'s Llama layers runs as one op per
    projection on our CPU kernel (workers.models.cpu.cpu_kernels.rotary_embedding: bit-identical, and
    differentiable, so prefills and the update both use it) instead of transformers' ten. transformers
    calls it as a function of the layer's modeling module, so that function is what is replaced,
    for every model of the module while any block is open (counted: sampling and the update may
    overlap in one process); calls the kernel does not take (float32, CUDA) go to transformers'
    own. Yields how many layers use it."""
    from workers.models.cpu import cpu_kernels

    layers = [m for m in model.modules() if type(m).__name__ in LLAMA_ROTARY_LAYERS]
    modules = {importlib.import_module(type(layer).__module__) for layer in layers}
    if not layers or not on_cpu(model) or cpu_kernels.load() is None or \
            not all(hasattr(m, "apply_rotary_pos_emb") for m in modules):
        yield 0
        return
    with _rotary_lock:
        for module in modules:
            original, users = _rotary_patched.get(module, (module.apply_rotary_pos_emb, 0))
            if not users:
                module.apply_rotary_pos_emb = partial(_fused_rotary, original)
            _rotary_patched[module] = (original, users + 1)
    try:
        yield len(layers)
    finally:
        with _rotary_lock:
            for module in modules:
                original, users = _rotary_patched.pop(module)
                if users > 1:
                    _rotary_patched[module] = (original, users - 1)
                else:
                    module.apply_rotary_pos_emb = original


def _fused_rotary(original: Callable[..., Any], q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
    from workers.models.cpu import cpu_kernels

    out = cpu_kernels.rotary_embedding(q, k, cos, sin) if unsqueeze_dim == 1 else None
    return original(q, k, cos, sin, unsqueeze_dim) if out is None else out


@contextmanager
def packed_linear_weights(model: Any) -> Iterator[int]:
    """Inside the block (inference only), each bfloat16 `nn.Linear` of `model` on a CPU with
    oneDNN runs on a copy of its weight reordered once into oneDNN's blocked layout, where torch's
    linear reorders the weight on every call: decode steps' matmuls read their weights ~1.5x
    faster, prefills' too (benchmarks/engine); the output is bit-identical (the same kernel).
    Projections that read the same input (a layer's q, k and v; gate and up) share one matmul
    over their weights stacked (SIBLING_PROJECTIONS): at a decode step's 16 rows a oneDNN call
    costs about as much in fixed overhead as in reading a small weight, and each output column is
    the same dot product, so the outputs are bit-identical too. The copies (the weights' size
    again) are freed on exit, when the layers get their forward back. Yields how many layers were
    packed; 0 where there is nothing to pack (float32, CUDA, no oneDNN bf16)."""
    layers = _packable_linear_layers(model)
    try:
        for group in _sibling_groups(model, layers):
            _PackedSiblings(group)
        for layer in layers:
            if "forward" not in layer.__dict__:
                packed = PackedWeight(_pack(layer.weight), _bias(layer), [layer.out_features], [layer])
                layer.forward, layer.__dict__[PACKED] = packed, packed
        yield len(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop(PACKED, None)


PACKED = "_agent_rft_packed"  # a packed layer's PackedWeight (lean_decode reads it)


@dataclass
class PackedWeight:
    """A weight reordered for oneDNN: one layer's, or its siblings' stacked (`layers`, each
    `sizes[i]` output columns of the one matmul, in order)."""

    weight: Any
    bias: Any
    sizes: list[int]
    layers: list[Any]

    def __call__(self, x: Any) -> Any:
        return _packed_linear(x, self.weight, self.bias)


def packed_weight(layer: Any) -> PackedWeight | None:
    """The packed weight a layer runs on inside packed_linear_weights (through a merged LoRA
    wrapper, whose forward is its base layer's), else None."""
    if getattr(layer, "base_layer", None) is not None:
        if not getattr(layer, "merged", False):
            return None
        layer = layer.base_layer
    return layer.__dict__.get(PACKED)


# Linear layers a module feeds the same input, in the order it calls them (transformers' Llama
# family: Llama, Mistral, Qwen2/3, SmolLM, ...); elsewhere each layer is packed alone.
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _packable_linear_layers(model: Any) -> list[Any]:
    import torch

    if not native_bf16_cpu():
        return []
    return [module for module in model.modules()
            if type(module) is torch.nn.Linear and "forward" not in module.__dict__
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.bfloat16]


def _sibling_groups(model: Any, layers: list[Any]) -> list[list[Any]]:
    """Groups of packable layers that one module feeds the same input (SIBLING_PROJECTIONS),
    through a LoRA wrapper or not (merged, peft's wrapper calls its base layer with its input)."""
    packable = {id(layer) for layer in layers}
    groups = []
    for module in model.modules():
        for names in SIBLING_PROJECTIONS:
            members = [getattr(module, name, None) for name in names]
            members = [getattr(m, "base_layer", m) for m in members]
            if all(id(m) in packable for m in members) and len({m.in_features for m in members}) == 1 \
                    and len({m.bias is None for m in members}) == 1:
                groups.append(members)
    return groups


class _PackedSiblings:
    """One matmul for layers fed the same input: the first of them to see an input computes all
    their outputs (column slices of one result), the others take theirs if they are called with
    that same tensor, else compute again. Each output is handed out once, then dropped. The
    outputs waiting are per thread, so two threads running the model never take each other's."""

    def __init__(self, layers: list[Any]) -> None:
        import torch

        bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
        self.packed = PackedWeight(_pack(torch.cat([layer.weight for layer in layers])), bias,
                                   [layer.out_features for layer in layers], layers)
        self.waiting = threading.local()  # .input, and .outputs: {layer index: its slice}
        for index, layer in enumerate(layers):
            layer.forward, layer.__dict__[PACKED] = partial(self.forward, index), self.packed

    def forward(self, index: int, x: Any) -> Any:
        waiting = self.waiting
        outputs = waiting.outputs if getattr(waiting, "input", None) is x else {}
        if index not in outputs:
            outputs = dict(enumerate(self.packed(x).split(self.packed.sizes, dim=-1)))
        out = outputs.pop(index)
        waiting.input, waiting.outputs = (x, outputs) if outputs else (None, {})
        return out


def _pack(weight: Any) -> Any:
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def _bias(layer: Any) -> Any:
    return None if layer.bias is None else layer.bias.detach()


def _packed_linear(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@contextmanager
def merged_lora_weights(model: Any) -> Iterator[int]:
    """Inside the block, each LoRA linear layer of `model` runs as one matmul on W + scale * B A
    (computed in float32, rounded once to W's dtype) instead of W x + B (A x) with its float32
    casts: ~1 s per 16-row prefill and ~11 ms per decode step of the demo's model on CPU. The
    original weight tensors are put back on exit, untouched (merging in place and unmerging would
    round them a little more every step); yields how many layers were merged. Layers it cannot
    merge exactly (DoRA and other variants, several active adapters, disabled adapters, already
    merged) keep running unmerged. Not for a model another thread trains or switches adapters on."""
    swapped = [(layer, layer.base_layer.weight.data) for layer in _mergeable_lora_layers(model)]
    try:
        import torch

        with torch.no_grad():
            for layer, weight in swapped:
                (name,) = layer.active_adapters
                b, a = layer.lora_B[name].weight.float(), layer.lora_A[name].weight.float()
                merged = weight.to(torch.float32, copy=True).addmm_(b, a, alpha=layer.scaling[name])
                layer.base_layer.weight.data = merged.to(weight.dtype)
                layer.merged_adapters = [name]
        yield len(swapped)
    finally:
        for layer, weight in swapped:
            layer.base_layer.weight.data = weight
            layer.merged_adapters = []


def _mergeable_lora_layers(model: Any) -> list[Any]:
    if importlib.util.find_spec("peft") is None:
        return []
    from peft.tuners.lora import Linear as LoraLinear

    return [
        module for module in model.modules()
        if isinstance(module, LoraLinear) and not module.merged and not module.disable_adapters
        and not module.fan_in_fan_out and len(module.active_adapters) == 1
        and module.active_adapters[0] in module.lora_A and module.active_adapters[0] not in module.lora_variant
        and module.base_layer.weight.dtype.is_floating_point  # not a quantized base
    ]


@contextmanager
def adapters_in_model_dtype(model: Any) -> Iterator[None]:
    """Run LoRA adapters in the base model's dtype when it is bfloat16 or float16: their float32
    weights (the optimizer's master copy) are cast down per matmul (rank x hidden values) instead
    of every activation being cast up to float32 and the sum back down, ~14 % of a LoRA update's
    CPU time. The gradient still reaches the float32 weights. Measured against a float32 copy of
    the model, bf16 log-probs are as close either way (benchmarks/engine). A no-op otherwise."""
    import torch

    dtype = next(model.parameters()).dtype
    lora = importlib.util.find_spec("peft") is not None and hasattr(model, "peft_config")
    if not lora or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    device = next(model.parameters()).device
    with disable_input_dtype_casting(model), torch.autocast(device.type, dtype=dtype):
        yield
