"""Attention of one-token queries (decode steps) on the CPU, by a kernel of our own.

torch's CPU flash attention runs a decode step's attention as small blocked matmuls with a
handful of query rows each, and read SmolLM2-135M's KV cache at ~10 GB/s: the attention was a
fifth to a half of a decode step (benchmarks/engine). `kernels/decode_attention.cpp` reads each
cached key and value once per (row, KV head), with the KV head's query heads in registers, at
~20 GB/s on the same machine; float32 accumulation, one rounding of the output (its bfloat16
results are closer to float32's than sdpa's), and a row's result never depends on the batch it
runs in.

It is compiled for this machine (`-march=native`) by torch's extension builder on first use
(~40 s, needs a C++ compiler and ninja; cached per CPU under `TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions`). `python -m workers.rl.decode_attention` builds it ahead (the demo and
the test script do). Where it cannot be built, decoding uses sdpa, after one warning.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.cpp"
NAME = "agent_rft_decode_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
DISABLE = "AGENT_RFT_DECODE_KERNEL"  # "0": decode on sdpa (benchmarks compare the two)

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
            (directory / "lock").unlink(missing_ok=True)
            return load_extension(NAME, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                  build_directory=str(directory), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: sdpa still works
        log.warning("decode attention kernel not built (%s: %s); decoding uses sdpa", type(exc).__name__, exc)
        return False


def build_directory() -> Path:
    """Where the kernel is built: per CPU model and instruction set (it is compiled with
    -march=native, so a home directory shared by different machines must not share the binary)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")).expanduser()
    return root / f"{NAME}-{_cpu_fingerprint()}"


def _cpu_fingerprint() -> str:
    import hashlib
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        described = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    except OSError:
        described = []
    return hashlib.sha256("\n".join([platform.machine(), *described]).encode()).hexdigest()[:12]


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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("decode attention kernel:", "built" if load() is not None else "not available (sdpa is used)")
