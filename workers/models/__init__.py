"""Models: a name turned into a loaded policy (a transformers model and its tokenizer), by concern:
- `registry.py`: names, sources and the conversion cache;
- `loading.py`: loading onto a device in a precision;
- `lora.py`: LoRA, the training modes and a job's starting weights;
- `cpu/`: the CPU speed-ups of sampling and training.

Importing `registry` imports no torch: the API resolves and validates model names with it. The
models import nothing of the engine, training or the methods above them.
"""
