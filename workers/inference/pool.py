"""The models an inference server holds: each base model loaded once, and a bounded LRU pool of
fine-tuned models on top (LoRA adapters on their base, or whole full-fine-tuned checkpoints).

LoRA adapters of one base share one PEFT wrapper (`PeftModel`, multi-adapter): a request for an
adapter activates it (`set_adapter`), a request for the base runs with the adapters switched off
(`disable_adapter`). The pool holds at most `capacity` fine-tuned models; the least recently used
is evicted (`delete_adapter`, or the full model dropped) and loaded again on its next request.

Requests are generated on the weights the rollout engine samples on (models.sampling_weights: the
active adapter merged, weights packed for oneDNN, the lean decode step), so a served model
computes what the trained policy sampled. Preparing them takes 0.1-0.3 s for SmolLM2-135M (about
ten decode steps), so the last model generated with stays prepared (`prepared`) until another
one is asked for or the pool loads or evicts a model. Not thread-safe: the inference server calls
it from its one generation thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.inference.served import (  # noqa: F401 - the pool's callers import them from here too
    ModelUnavailable, ServedModel, checked_checkpoint_directory, checkpoint_kind,
)
from workers.models.cpu.cpu_speedups import sampling_weights
from workers.models.loading import load_model, release_freed_memory
from workers.models.registry import LoadedModel, ModelError
from workers.engine.prompting import ChatFormatter

log = logging.getLogger(__name__)


@dataclass
class PooledModel(ServedModel):
    """A served model of the pool: the module to call (with `activate()`)."""

    _module: Any = None
    _adapter: str | None = None  # the PEFT adapter name; None: the base with adapters switched off
    _peft: Any = None

    @contextlib.contextmanager
    def activate(self) -> Iterator[Any]:
        """The module to generate with, set up for this model for the duration of the block."""
        if self._peft is None:
            yield self._module
        elif self._adapter is None:
            with self._peft.disable_adapter():
                yield self._peft
        else:
            self._peft.set_adapter(self._adapter)
            yield self._peft


@dataclass
class _Base:
    loaded: LoadedModel
    formatter: ChatFormatter
    peft: Any = None  # the PeftModel holding this base's adapters, once one is loaded


@dataclass
class PoolStats:
    loads: int = 0
    preparations: int = 0  # models put on their sampling weights (`prepared`)
    evictions: int = 0
    load_seconds: list[float] = field(default_factory=list)


class ModelPool:
    def __init__(self, *, bases: list[str], capacity: int, dtype: str | None = None,
                 checkpoint_root: Path | None = None) -> None:
        self.allowed_bases = {name.casefold(): name for name in bases}
        self.capacity = capacity
        self.dtype = dtype
        self.checkpoint_root = checkpoint_root.resolve() if checkpoint_root else None
        self._bases: dict[str, _Base] = {}
        self._finetuned: OrderedDict[str, PooledModel] = OrderedDict()  # LRU: oldest first
        self._adapter_names = 0
        self.stats = PoolStats()
        # The model generated with last, still activated on its sampling weights (`prepared`):
        # (its module and adapter, the module to call, the contexts to close).
        self._prepared: tuple[tuple[int, str | None], Any, contextlib.ExitStack] | None = None

    # -- what is loaded ---------------------------------------------------------------------------

    def loaded_keys(self) -> list[str]:
        """The fine-tuned models in the pool, least recently used first."""
        return list(self._finetuned)

    def get(self, base: str, checkpoint_path: str | None) -> PooledModel:
        """The model for a request: the base itself, or a checkpoint of it (loaded if needed)."""
        base_entry = self._base(base)
        if checkpoint_path is None:
            return self._base_served(base, base_entry)
        directory = self._checked_directory(checkpoint_path)
        key = str(directory)
        served = self._finetuned.get(key)
        if served is not None:
            self._finetuned.move_to_end(key)
            return served
        started = time.perf_counter()
        served = self._load_checkpoint(key, directory, base_entry)
        self.stats.loads += 1
        self.stats.load_seconds.append(time.perf_counter() - started)
        self._finetuned[key] = served
        while len(self._finetuned) > self.capacity:
            self._evict(*self._finetuned.popitem(last=False))
        return served

    def prepared(self, served: PooledModel) -> Any:
        """The module to generate `served` with: activated (its adapter set, or adapters off for a
        base) on its sampling weights, and kept so until another model is prepared or the pool
        loads or evicts one."""
        key = (id(served._module), served._adapter)
        if self._prepared is None or self._prepared[0] != key:
            self.unprepare()
            with contextlib.ExitStack() as stack:  # closed here only if preparing fails
                module = stack.enter_context(served.activate())
                counts = stack.enter_context(sampling_weights(module))
                self._prepared = (key, module, stack.pop_all())
            self.stats.preparations += 1
            log.debug("prepared %s for generation: %s", served.key, counts)
        return self._prepared[1]

    def unprepare(self) -> None:
        """Put the prepared model's weights and adapters back as they were loaded."""
        if self._prepared is not None:
            _, _, stack = self._prepared
            self._prepared = None
            stack.close()

    # -- bases ------------------------------------------------------------------------------------

    def _base(self, name: str) -> _Base:
        canonical = self.allowed_bases.get(name.casefold())
        if canonical is None:
            raise ModelUnavailable(404, "model_not_found", f"This inference server does not serve the base model "
                                                           f"'{name}' (it serves {', '.join(self.allowed_bases.values())}).")
        entry = self._bases.get(canonical)
        if entry is None:
            self.unprepare()
            try:
                loaded = load_model(canonical, dtype=self.dtype)
            except ModelError as exc:
                raise ModelUnavailable(503, "model_unavailable", f"Cannot load '{canonical}': {exc}") from exc
            entry = self._bases[canonical] = _Base(loaded, ChatFormatter(loaded.tokenizer))
        return entry

    def _base_served(self, name: str, entry: _Base) -> PooledModel:
        return PooledModel(key=name, tokenizer=entry.loaded.tokenizer, formatter=entry.formatter,
                           max_context=_max_context(entry.loaded.model), _module=entry.loaded.model, _peft=entry.peft)

    # -- checkpoints --------------------------------------------------------------------------------

    def _checked_directory(self, checkpoint_path: str) -> Path:
        return checked_checkpoint_directory(checkpoint_path, self.checkpoint_root)

    def _load_checkpoint(self, key: str, directory: Path, base: _Base) -> PooledModel:
        self.unprepare()  # loading wraps or adds to a base's layers: on the weights as they were loaded
        if checkpoint_kind(directory) == "lora":
            return self._load_adapter(key, directory, base)
        return self._load_full(key, directory)

    def _load_adapter(self, key: str, directory: Path, base: _Base) -> PooledModel:
        from peft import PeftModel

        self._adapter_names += 1
        name = f"adapter{self._adapter_names}"
        try:
            if base.peft is None:
                base.peft = PeftModel.from_pretrained(base.loaded.model, str(directory), adapter_name=name)
                base.peft.eval()
            else:
                base.peft.load_adapter(str(directory), adapter_name=name)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ModelUnavailable(404, "checkpoint_files_missing", f"The checkpoint's LoRA adapter cannot be loaded: {exc}") from exc
        return PooledModel(key=key, tokenizer=base.loaded.tokenizer, formatter=base.formatter,
                           max_context=_max_context(base.loaded.model), _module=base.peft, _adapter=name, _peft=base.peft)

    def _load_full(self, key: str, directory: Path) -> PooledModel:
        try:
            loaded = load_model(str(directory), dtype=self.dtype)
        except ModelError as exc:
            raise ModelUnavailable(404, "checkpoint_files_missing", f"The checkpoint cannot be loaded: {exc}") from exc
        return PooledModel(key=key, tokenizer=loaded.tokenizer, formatter=ChatFormatter(loaded.tokenizer),
                           max_context=_max_context(loaded.model), _module=loaded.model)

    def _evict(self, key: str, served: PooledModel) -> None:
        self.unprepare()
        if served._adapter is not None:
            served._peft.delete_adapter(served._adapter)
        self.stats.evictions += 1
        log.info("evicted %s from the model pool", key)
        release_freed_memory()


def _max_context(model: Any) -> int:
    return int(getattr(model.config, "max_position_embeddings", 8192))
