"""Engine benchmark (issue 15), old and new paths interleaved in one run, medians.

Measured so far: sampling with a contiguous input to the output layer (workers/rl/models.py
`contiguous_head_input`) against the previous path (the hook removed), on the demo's shape: the
LoRA-wrapped SmolLM2-135M, 16 rows of ~458 prompt tokens, 48 new tokens, in bfloat16 where the CPU
has native bf16. Prints a table, checks that tokens and log-probs are bit-identical, writes
benchmarks/results/engine.json.

    .venv/bin/python -m benchmarks.engine.run [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from workers.rl.generation import GenerationRequest, generate_batch
from workers.rl.models import HEAD_HOOK, apply_lora, contiguous_head_input, load_model, native_bf16_cpu

RESULTS = Path(__file__).resolve().parents[1] / "results" / "engine.json"
MODEL = "SmolLM2-135M-Instruct"
ROWS, NEW_TOKENS = 16, 48
TEXT = "In 2022 the company reported revenue of $713,837 thousand, up from $650,112 thousand in 2021. "


def requests(tokenizer: Any) -> list[GenerationRequest]:
    ids = tokenizer.encode(TEXT * 40)
    return [GenerationRequest(context_ids=ids[: 440 + 2 * i], max_new_tokens=NEW_TOKENS, seed=i) for i in range(ROWS)]


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = "bfloat16" if native_bf16_cpu() or torch.cuda.is_available() else "float32"
    loaded = load_model(MODEL, dtype=dtype)
    policy = apply_lora(loaded, rank=16, alpha=32).eval()
    head = loaded.model.get_output_embeddings()
    batch = requests(loaded.tokenizer)
    prefill_ids = torch.tensor([r.context_ids[:440] for r in batch])
    pad = loaded.tokenizer.pad_token_id

    def use(path: str) -> None:
        if path == "old" and hasattr(head, HEAD_HOOK):
            getattr(head, HEAD_HOOK).remove()
            delattr(head, HEAD_HOOK)
        elif path == "new":
            contiguous_head_input(loaded.model)

    times: dict[str, dict[str, list[float]]] = {p: {"generation_s": [], "prefill_s": []} for p in ("old", "new")}
    outputs: dict[str, Any] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for path in ("old", "new"):
                use(path)
                seconds, out = timed(lambda: generate_batch(policy, batch, pad_token_id=pad, temperature=1.0))
                times[path]["generation_s"].append(seconds)
                outputs[path] = [(o.token_ids, o.logprobs) for o in out]
                seconds, _ = timed(lambda: policy(input_ids=prefill_ids, logits_to_keep=1))
                times[path]["prefill_s"].append(seconds)
    medians = {p: {k: statistics.median(v) for k, v in m.items()} for p, m in times.items()}
    identical = outputs["old"] == outputs["new"]
    out = {"model": MODEL, "dtype": dtype, "rows": ROWS, "new_tokens": NEW_TOKENS, "repeats": args.repeats,
           "torch_threads": torch.get_num_threads(), "runs": times, "medians": medians,
           "ratio_new_over_old": {k: medians["new"][k] / medians["old"][k] for k in medians["new"]},
           "tokens_and_logprobs_identical": identical}
    print("| measure (LoRA SmolLM2, 16 rows) | old | new | new / old |\n|---|---|---|---|")
    for key, label in (("prefill_s", "prefill of 16 x 440 tokens"), ("generation_s", "generation: prompt + 48 tokens")):
        print(f"| {label} | {medians['old'][key]:.2f} s | {medians['new'][key]:.2f} s | "
              f"{out['ratio_new_over_old'][key]:.2f} |")
    print(f"tokens and log-probs identical: {identical}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
