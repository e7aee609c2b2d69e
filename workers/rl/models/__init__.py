"""Models: a name turned into a loaded policy (a transformers model and its tokenizer), by concern:
- `registry.py`: names, sources and the conversion cache;
- `loading.py`: loading onto a device in a precision;
- `lora.py`: LoRA and the training modes;
- `cpu_speedups.py`: the CPU speed-ups of sampling and training.

Importing it imports no torch: the API resolves and validates model names with it.
"""

from workers.rl.models.registry import (  # noqa: F401
    ATTENTION_PROJECTIONS,
    CACHE_DIR_ENV,
    CACHE_FORMAT,
    CACHE_LOCK_TIMEOUT_S,
    CACHE_MARKER,
    DEFAULT_CACHE_DIR,
    HUB_PROBE_TIMEOUT_S,
    LoadedModel,
    MLP_PROJECTIONS,
    ModelError,
    ModelNotAvailable,
    ModelSource,
    NAME_FORMS,
    SMOLLM2,
    SMOLLM2_PACKAGE,
    SMOLLM2_PIP_HINT,
    SourceKind,
    TINY_SEED,
    TINY_SHAPE,
    TINY_SMOLLM2,
    TrainingMode,
    UnknownModel,
    ensure_gguf_cached,
    ensure_tiny_cached,
    list_models,
    load_gguf,
    model_cache_dir,
    packaged_gguf_path,
    resolve_model,
    save_model_dir,
)
from workers.rl.models.loading import (  # noqa: F401
    ATTENTION,
    HEAD_HOOK,
    contiguous_head_input,
    load_model,
    load_tokenizer,
    model_directory,
    native_bf16_cpu,
    on_cpu,
    packed_decode_attention,
    pick_device,
    pick_dtype,
    release_freed_memory,
)
from workers.rl.models.lora import (  # noqa: F401
    apply_lora,
    continue_from_adapter,
    count_parameters,
    load_start,
    training_mode,
)
from workers.rl.models.cpu_speedups import (  # noqa: F401
    LLAMA_RMS_NORMS,
    LLAMA_ROTARY_LAYERS,
    PACKED,
    PackedWeight,
    SIBLING_PROJECTIONS,
    adapters_in_model_dtype,
    cpu_speedups,
    fused_rms_norms,
    fused_rotary,
    merged_lora_weights,
    packed_linear_weights,
    packed_weight,
    sampling_weights,
)
