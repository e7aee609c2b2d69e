"""CPU kernels of our own: decode attention, RMSNorm and rotary for sampling; RMSNorm's backward and
causal attention's softmax backward for the update (`kernels/*.cpp`, one extension).

- **Decode attention** (`attend`). torch's CPU flash attention runs a decode step's attention as
  small blocked matmuls with a handful of query rows each, and read SmolLM2-135M's KV cache at
  ~10 GB/s: the attention was a fifth to a half of a decode step (benchmarks/engine).
  `kernels/decode_attention.cpp` reads each cached key and value once per (row, KV head), with
  the KV head's query heads in registers, at ~20 GB/s on the same machine; float32 accumulation,
  one rounding of the output (its bfloat16 results are closer to float32's than sdpa's), and a
  row's result never depends on the batch it runs in.
- **RMSNorm** (`rms_norm`). transformers' LlamaRMSNorm is eight dispatched ops, 61 times a decode
  step; `kernels/rms_norm.cpp` does it in one pass with torch's roundings (~5 us against ~21 at a
  decode step's 16 rows). The update runs its norms on it too, with a backward of one pass per row
  (`rms_norm_backward`, where autograd ran ~ten ops over float32 copies).
- **Causal attention's backward** (`causal_softmax_backward`, for workers/models/cpu/training_attention.py):
  P and dS from the float32 scores in one pass, between the large matmuls that replace torch's
  flash backward (~5x its forward on the CPU).

They are compiled for this machine (`-march=native`) by torch's extension builder on first use
(~40-60 s, needs a C++ compiler and ninja; cached per CPU and content under `TORCH_EXTENSIONS_DIR`,
by default `~/.cache/torch_extensions`, and imported from there by later processes, whatever path
the sources are read from). `python -m workers.models.cpu.cpu_kernels` builds them ahead (the
demo and the test script do). Where they cannot be built, sampling and the update use torch's ops (sdpa,
transformers' norm, flash's backward), after one warning; `AGENT_RFT_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("kernels").glob("*.cpp"))
NAME = "agent_rft_cpu_kernels"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
DISABLE = "AGENT_RFT_CPU_KERNELS"  # "0": torch's ops instead (benchmarks compare the two)

_lock = threading.Lock()
_module: Any = None  # the built extension, False where it cannot be built, None before the first try


def enabled() -> bool:
    return os.environ.get(DISABLE, "1") != "0"


def load() -> Any:
    """The compiled kernel module, building it the first time; None where it cannot be built
    (logged once) or is disabled."""
    global _module
    if not enabled():
        return None
    if _module is None:  # the lock only until the first build: every decode step's layers call this
        with _lock:
            if _module is None:
                _module = _build()
    return _module or None


def _build() -> Any:
    from filelock import FileLock
    from torch.utils.cpp_extension import load as load_extension

    try:
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        # torch's own build lock is a plain file that a killed build leaves behind, and every later
        # load then waits on it forever; this OS lock dies with its process, so whoever holds it
        # knows a leftover torch lock is stale.
        with FileLock(str(directory / "agent-rft.lock"), timeout=600):
            built = _import_built(directory)
            if built is not None:
                return built
            (directory / "lock").unlink(missing_ok=True)
            return load_extension(NAME, [str(source) for source in SOURCES], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: torch's ops still work
        log.warning("CPU kernels not built (%s: %s); sampling uses torch's ops", type(exc).__name__, exc)
        return False


def _import_built(directory: Path) -> Any:
    """The extension already built in `directory`, imported without asking ninja; None if there is
    none. Ninja would rebuild whenever the command line differs, and the command names the sources'
    absolute paths: another checkout or install of the same code (a new release directory after a
    deploy), or a ninja of another version (which rejects the other's build log), recompiled for a
    minute or more although nothing that goes into the binary changed. The directory's name already
    says what does (build_directory)."""
    import importlib.util

    library = directory / f"{NAME}.so"
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(NAME, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:  # e.g. cut short by a build that was killed: build it again
        log.warning("CPU kernels in %s do not load (%s); building them again", directory, exc)
        library.unlink(missing_ok=True)
        return None
    return module


def build_directory() -> Path:
    """Where the kernels are built: one directory per CPU (they are compiled with -march=native, so
    a home directory shared by different machines must not share the binary) and per content: the
    sources' bytes, the flags, torch and the compiler. Another path to the same code shares the
    build; a change to any of these builds anew beside it."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")).expanduser()
    return root / f"{NAME}-{_cpu_fingerprint()}-{_content_fingerprint()}"


def _cpu_fingerprint() -> str:
    import hashlib
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        described = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    except OSError:
        described = []
    return hashlib.sha256("\n".join([platform.machine(), *described]).encode()).hexdigest()[:12]


def _content_fingerprint() -> str:
    import hashlib
    import subprocess
    import sys

    digest = hashlib.sha256()
    for source in sorted(Path(__file__).with_name("kernels").iterdir()):  # the headers too
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    compiler = os.environ.get("CXX", "c++")
    try:
        compiler_version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        compiler_version = "unknown"
    for part in (*FLAGS, torch.__version__, sys.version, compiler, compiler_version):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:12]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           scale: float) -> torch.Tensor | None:
    """softmax(q k^T * scale) v for query [rows, kv heads, query heads per kv head, dim] against key
    and value [rows, kv heads, length, dim], with transformers' boolean sdpa mask [rows, 1, 1,
    length] (True: attend) or none; the output has the query's shape. None where the kernel does
    not apply (not built, not a CPU tensor, another dtype or mask form): the caller uses sdpa."""
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float32):
        return None
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    keep = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1):
            return None
        keep = attention_mask[:, 0, 0, :]
        if keep.stride(-1) != 1 or keep.shape != (key.shape[0], key.shape[2]):
            return None
    module = load()
    if module is None:
        return None
    return module.decode_attention(query.contiguous(), key, value, keep, float(scale))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' LlamaRMSNorm of x [..., hidden] with weight [hidden] (kernels/rms_norm.cpp);
    None where the kernel does not apply (not built, not a CPU tensor, another dtype, a weight of
    another dtype than x, which torch would promote, a weight being trained): the caller runs the
    module's own forward. Differentiable in x: where autograd records x, its gradient comes from
    `rms_norm_backward` (one pass per row, where autograd ran ~ten ops over float32 copies)."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype:
        return None
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0] or torch.is_grad_enabled() and weight.requires_grad:
        return None
    module = load()
    if module is None:
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return _RMSNorm.apply(x.contiguous(), weight.contiguous(), float(eps))
    return module.rms_norm(x.contiguous(), weight.contiguous(), float(eps))


class _RMSNorm(torch.autograd.Function):
    """The kernel's norm with its gradient in x (the weight is frozen: LoRA and the update's
    reference never train a norm; a trained weight takes transformers' own ops)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _module.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        return _module.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps), None, None


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' apply_rotary_pos_emb of query and key [batch, heads, length, dim] (as transformers
    hands them over: transposed views of the projections' [batch, length, heads, dim]) with cos and
    sin [batch, length, dim], bit for bit (kernels/rotary.cpp), differentiable in both; None where
    the kernel does not apply (not built, not bfloat16 on the CPU, other shapes)."""
    tensors = (query, key, cos, sin)
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in tensors) or cos.dim() != 3:
        return None
    if query.dim() != 4 or key.dim() != 4 or cos.shape != sin.shape or cos.shape[-2:] != query.shape[-2:]:
        return None
    module = load()
    if module is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    rotated = []
    for x in (query, key):
        by_position = x.transpose(1, 2).contiguous()
        if torch.is_grad_enabled() and x.requires_grad:
            out = _Rotary.apply(by_position, cos, sin)
        else:
            out = module.rotary_positions(by_position, cos, sin)
        rotated.append(out.transpose(1, 2))
    return rotated[0], rotated[1]


class _Rotary(torch.autograd.Function):
    """The rotation is linear in x: its gradient is the transposed rotation of the incoming one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _module.rotary_positions(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _module.rotary_positions_backward(grad.contiguous(), cos, sin), None, None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("CPU kernels:", "built" if load() is not None else "not available (torch's ops are used)")
