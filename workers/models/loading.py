"""Loading a model by name onto a device in a precision: the weights, the tokenizer, the devices
and dtypes, and the two changes every loaded model gets (the output layer's contiguous input,
the decode attention that packs one-token queries)."""

from __future__ import annotations

import hashlib
import logging
import os
import time

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from workers.models.registry import (
    _LOAD_LOCK,
    SMOLLM2,
    LoadedModel,
    ModelNotAvailable,
    ModelSource,
    UnknownModel,
    _hub_kwargs,
    ensure_gguf_cached,
    ensure_tiny_cached,
    model_cache_dir,
    packaged_gguf_path,
    resolve_model,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Loading


def load_model(
    name: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load `name` (see NAME_FORMS) for generation. Defaults: CUDA in bfloat16 when available,
    else CPU in float32; explicit `device` / `dtype` override. GGUF and tiny models are converted
    into the cache on first use (seconds for tiny, ~30 s for SmolLM2) and loaded from it after."""
    source = resolve_model(name)
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    started = time.perf_counter()
    # One load at a time per process: transformers' from_pretrained / from_config swap global
    # state while they build a model, so two threads loading at once get meta or untied weights.
    with _LOAD_LOCK:
        location, hub_kwargs = _pretrained_location(source, model_cache_dir(cache_dir))
        tokenizer = _load_tokenizer(source, location, hub_kwargs)
        model = _load_weights(source, location, hub_kwargs, torch_dtype).to(torch_device)
    model.eval()
    contiguous_head_input(model)
    packed_decode_attention(model)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    log.info("loaded %s from %s in %.1f s", source.name, location, time.perf_counter() - started)
    return LoadedModel(model, tokenizer, source.name, torch_device, torch_dtype, source, location)


def load_tokenizer(name: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer of `name` alone, without its weights: what a front end of another inference
    server (vLLM) needs to render prompts and read answers as the rollout engine does."""
    source = resolve_model(name)
    with _LOAD_LOCK:
        location, hub_kwargs = _pretrained_location(source, model_cache_dir(cache_dir))
        return _load_tokenizer(source, location, hub_kwargs)


def model_directory(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory of safetensors and tokenizer files that `name` loads from (converted into the
    cache first for the built-in and GGUF models): what an inference server such as vLLM is given
    to serve the same weights. UnknownModel for a Hub id, which a server loads by its id."""
    source = resolve_model(name)
    if source.kind == "hub":
        raise UnknownModel(f"{name!r} is a Hugging Face id: serve it by that id")
    return Path(_pretrained_location(source, model_cache_dir(cache_dir))[0])


def _pretrained_location(source: ModelSource, root: Path) -> tuple[str, dict[str, Any]]:
    """What to pass to from_pretrained: a directory (converted into the cache first where the
    source is GGUF or tiny) or a Hub id, plus keyword arguments for the Hub."""
    if source.kind == "packaged_gguf":
        return str(ensure_gguf_cached(packaged_gguf_path(), root, key=SMOLLM2)), {}
    if source.kind == "tiny":
        return str(ensure_tiny_cached(root)), {}
    if source.kind == "gguf_file":
        gguf = Path(source.location)
        key = f"gguf-{gguf.stem}-{hashlib.sha256(str(gguf).encode()).hexdigest()[:8]}"
        return str(ensure_gguf_cached(gguf, root, key=key)), {}
    if source.kind == "local_dir":
        return source.location, {}
    return source.location, _hub_kwargs(source.location)


def _load_tokenizer(source: ModelSource, location: str, hub_kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, padding_side="left", **hub_kwargs)
    except (OSError, ValueError) as exc:
        raise ModelNotAvailable(f"cannot load the tokenizer of {source.name} from {location}: {exc}") from exc
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts pad on the left
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelNotAvailable(f"the tokenizer of {source.name} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_weights(source: ModelSource, location: str, hub_kwargs: dict[str, Any], dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **hub_kwargs)
    except (OSError, ValueError) as exc:
        raise ModelNotAvailable(f"cannot load the weights of {source.name} from {location}: {exc}") from exc


HEAD_HOOK = "_agent_rft_contiguous_input"  # the hook's handle, on the output layer


def contiguous_head_input(model: Any) -> None:
    """Hand the output layer a contiguous input. Sampling asks for the last position's logits only
    (`logits_to_keep=1`), and transformers passes `hidden[:, -1:, :]`, a strided view; for such a
    3-D input torch's linear falls back to a batched matmul that expands the [vocab, hidden] weight
    once per row ([rows, 576, 49152] for SmolLM2: ~0.9 GB in bf16 at 16 rows) on every prefill.
    A contiguous copy of the input is 16 x 576 values. The same tokens; log-probs bit-identical in
    bfloat16, equal to float32 rounding (~1e-5) in float32, where the kernels sum in another order
    (benchmarks/engine, tests/rl/test_contiguous_head.py)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or hasattr(head, HEAD_HOOK):
        return
    setattr(head, HEAD_HOOK, head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:])))


ATTENTION = "agent_rft_sdpa"  # transformers' sdpa, one-token queries packed per KV head (packed_decode_attention)


def packed_decode_attention(model: Any) -> None:
    """Use transformers' sdpa attention, except for one-token queries (decoding): there each KV
    head's query heads are packed as its queries, [rows, kv heads, group, dim], and one sdpa call
    reads every cache entry once. transformers instead asks torch for its grouped-query path
    (`enable_gqa`) when there is no mask, 3.2 ms per layer on a CPU at 16 rows x 300 tokens against
    0.7 ms packed, and with a padding mask (rows of different lengths, the common case in training)
    copies K and V once per query head (`repeat_kv`), 0.75 ms against 0.26 ms packed at 16 x 350.
    The packed attention itself runs on our decode kernel where it is built (workers.models.cpu.cpu_kernels:
    each key and value read once, ~2x sdpa's speed), else on sdpa; registering builds the kernel, so
    that the first decode step does not. Registered with transformers' AttentionInterface; prefill
    is plain sdpa, and the update's causal attention workers.models.cpu.training_attention (the flash
    forward, a backward of large matmuls)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not on_cpu(model):
        return  # on a GPU, transformers' own sdpa (and flash) paths stand
    from workers.models.cpu import cpu_kernels

    cpu_kernels.load()
    AttentionInterface.register(ATTENTION, _sdpa_packing_decode_queries)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def _sdpa_packing_decode_queries(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from workers.models.cpu import training_attention

    causal = getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
    if causal and training_attention.applies(query, key, attention_mask, **kwargs):
        out = training_attention.causal_attention(query, key, value, kwargs.get("scaling") or query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    groups = getattr(module, "num_key_value_groups", 1)
    # A mask of one row per sequence ([rows, 1, 1, keys]) broadcasts over the packed query heads.
    one_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if not one_mask or query.shape[2] != 1 or groups == 1 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    from workers.models.cpu import cpu_kernels

    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)  # query head h reads KV head h // groups
    scale = kwargs.get("scaling") or dim ** -0.5
    plain = not kwargs.get("dropout") and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
    out = cpu_kernels.attend(packed, key, value, attention_mask, scale) if plain else None
    if out is None:
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                               scale=scale)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def on_cpu(model: Any) -> bool:
    """Whether `model`'s weights are on the CPU: the CPU speed-ups (our compiled kernels, packed
    weights, the lean decode step, the registered attention) are built and applied only there, never
    for a CUDA (or any other) device, where torch's and transformers' own kernels are the fast path."""
    parameter = next(iter(model.parameters()), None)
    return parameter is not None and parameter.device.type == "cpu"


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device`, or CUDA when available, else CPU. Asking for CUDA where there is none is an error."""
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid device {device!r}: {exc}") from exc
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ModelNotAvailable(f"device {device!r} was requested but CUDA is not available here")
    return chosen


def native_bf16_cpu() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX, through oneDNN). There,
    SmolLM2-135M samples and trains about 1.5x faster in bfloat16 than in float32
    (benchmarks/precision); without it, bfloat16 is emulated and slower."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the probe: assume not
        return False


def release_freed_memory() -> int:
    """Hand the memory freed since the last call back to the OS (glibc's malloc_trim); returns
    1 if some was released, 0 if none or not on glibc. Sampling and updates allocate buffers of a
    new size at every step; glibc keeps the freed ones in its per-thread arenas, and on the CPU
    in bfloat16 (oneDNN's reorders) a training process grew by ~2.5 GB per step until the kernel
    killed it (24 GB after 8 steps of SmolLM2). The rollout engine calls this at the end of every
    run and the trainer after every update; it costs milliseconds."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = libc if hasattr(libc, "malloc_trim") else False
        except OSError:
            _LIBC = False
    return int(_LIBC.malloc_trim(0)) if _LIBC else 0


_LIBC: Any = None


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`dtype`, or bfloat16 on a GPU that supports it, else float32. "auto" never picks bfloat16
    on a CPU: it is slow without native support (see native_bf16_cpu) and its log-probs are
    coarser; jobs opt in with x_open_model.dtype. float16 training is unstable."""
    import torch

    if dtype is None or dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    }  # fmt: skip
    key = str(dtype).removeprefix("torch.").lower()
    if key not in names:
        raise ValueError(f"invalid dtype {dtype!r}; use one of {', '.join(names)}")
    return names[key]


