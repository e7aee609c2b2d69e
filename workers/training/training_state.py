"""The full state of a training run, saved at step boundaries so that a paused job, or a worker
killed with SIGKILL, resumes exactly where the last saved state left it (docs/training.md: model,
optimizer, RNG, step and data position).

A state directory holds
- `weights.safetensors`: every trainable parameter by name (the LoRA adapters, or all weights
  in full training);
- `optimizer.pt`: the optimizer's state dict (AdamW moments and step counts);
- `rng.pt`: the RNG states of Python's `random`, torch on the CPU and every CUDA device;
- `<name>.safetensors` for each extra set of tensors a method keeps (the reinforcement trainer's
  lagged sampling policy, when its sampling runs a step ahead);
- `state.json`, written last: step, trained tokens, data position (epoch, index in the epoch,
  the epoch's permutation) and the run's fingerprint (options that must not change on resume).

Saving is atomic: everything is written into a temporary directory next to the target, which
then replaces the target by rename. Between the two renames of a replacement the previous state
sits at `<target>.old`; `load_training_state` falls back to it, so a crash at any moment leaves
one complete state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_FORMAT = 1
STATE_FILE = "state.json"
WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"


class TrainingStateError(ValueError):
    """The saved state is missing, incomplete, or belongs to a different run configuration."""


@dataclass
class DataPosition:
    """Where the next batch starts: the epoch, the index within it, and the epoch's row order."""

    epoch: int = 0
    index: int = 0
    permutation: list[int] = field(default_factory=list)


@dataclass
class TrainingProgress:
    step: int = 0  # completed optimizer steps
    trained_tokens: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    fingerprint: dict[str, Any] = field(default_factory=dict)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (each tied tensor once), detached copies."""
    return {name: p.detach().clone().contiguous() for name, p in model.named_parameters() if p.requires_grad}


def capture_rng() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))  # torch.load returns the tuple as saved; be safe
    torch.set_rng_state(states["torch"])
    # Generation and training draw no global CUDA randomness; restored where the devices match.
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_training_state(target: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        progress: TrainingProgress, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write the state into `target` atomically (see the module docstring); returns `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):  # from a save that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(trainable_state(model), str(tmp / WEIGHTS_FILE))
        for name, tensors in (extra or {}).items():
            save_file({key: t.detach().contiguous() for key, t in tensors.items()}, str(tmp / f"{name}.safetensors"))
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        torch.save(capture_rng(), tmp / RNG_FILE)
        _write_synced(tmp / STATE_FILE, json.dumps({"format": STATE_FORMAT, **asdict(progress)}))
        _replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _replace_directory(new: Path, target: Path) -> None:
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def find_saved_state(target: Path) -> Path | None:
    """`target` when it holds a complete state, else `<target>.old` (a crash mid-replacement)."""
    target = Path(target)
    for candidate in (target, target.with_name(target.name + ".old")):
        if (candidate / STATE_FILE).is_file():
            return candidate
    return None


def load_training_state(target: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        fingerprint: dict[str, Any]) -> TrainingProgress:
    """Restore weights, optimizer and RNG from a saved state into `model` / `optimizer` (built as
    for the saved run) and return the progress. Raises TrainingStateError when the state is
    missing or was saved by a run with a different fingerprint."""
    found = find_saved_state(target)
    if found is None:
        raise TrainingStateError(f"no saved training state at {target}")
    progress = _read_progress(found)
    _check_fingerprint(progress.fingerprint, fingerprint)
    _load_weights(found / WEIGHTS_FILE, model)
    # Loaded onto the CPU: load_state_dict moves the moments to each parameter's device, so a
    # state saved on one GPU resumes on another (or on the CPU).
    optimizer.load_state_dict(torch.load(found / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    restore_rng(torch.load(found / RNG_FILE, map_location="cpu", weights_only=True))
    return progress


def load_extra_tensors(target: Path, name: str) -> dict[str, torch.Tensor] | None:
    """The extra tensors `name` saved with the state at `target` (on the CPU); None where it has none."""
    found = find_saved_state(target)
    path = found / f"{name}.safetensors" if found is not None else None
    return load_file(str(path)) if path is not None and path.is_file() else None


def _read_progress(directory: Path) -> TrainingProgress:
    try:
        raw = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrainingStateError(f"cannot read {directory / STATE_FILE}: {exc}") from exc
    if raw.get("format") != STATE_FORMAT:
        raise TrainingStateError(f"{directory} holds training state format {raw.get('format')!r}, "
                                 f"this version reads format {STATE_FORMAT}")
    return TrainingProgress(step=raw["step"], trained_tokens=raw["trained_tokens"],
                            position=DataPosition(**raw["position"]), fingerprint=raw["fingerprint"])


def _check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    current = json.loads(json.dumps(current))  # compare as JSON, as it was saved
    changed = {key: (saved.get(key), current.get(key)) for key in set(saved) | set(current)
               if saved.get(key) != current.get(key)}
    if changed:
        details = ", ".join(f"{key}: saved {old!r}, now {new!r}" for key, (old, new) in sorted(changed.items()))
        raise TrainingStateError(f"the saved training state belongs to a different run configuration ({details})")


def _load_weights(path: Path, model: torch.nn.Module) -> None:
    saved = load_file(str(path))
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(saved) != set(params):
        missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise TrainingStateError(f"the saved weights do not fit this model (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
    copy_tensors(saved, params)


def copy_tensors(source: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    """Copy each of `params` (by name) from `source`, onto the parameter's device and dtype."""
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(source[name].to(device=param.device, dtype=param.dtype))
