"""LoRA and training modes: wrapping a model in adapters, making every parameter trainable, and
starting from a fine-tuned model (its adapter continued, or merged)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from workers.models.loading import load_model
from workers.models.registry import ATTENTION_PROJECTIONS, LoadedModel, TrainingMode

log = logging.getLogger(__name__)

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


