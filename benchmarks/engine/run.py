"""Engine benchmark: the training engine's old and new paths interleaved in one run, medians.

On the LoRA-wrapped SmolLM2-135M in bfloat16 where the CPU has native bf16, LoRA B not zero:
- sampling with a contiguous input to the output layer (workers/models.py
  `contiguous_head_input`) against the previous path (the hook removed): 16 rows of ~458 prompt
  tokens, 48 new tokens; tokens and log-probs compared;
- bf16 log-probs of each path against a float32 copy of the model (what merging does);
- decode tokens/s: the generator before continuous batching against DecodeBatch, on the model and
  on the weights the engine samples on, against the bandwidth limit;
- the update's forward+backward over 16 sequences shaped like a demo step's (4 prompts x 4
  rollouts): the old forward in arrival order, sorted by length, the new forward, shared prompts,
  and the same on our kernels (the norm's backward, causal attention's backward).
Prints the tables and writes benchmarks/results/engine.json.

    .venv/bin/python -m benchmarks.engine.run [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import random

from benchmarks.engine import baseline_generation as baseline
from workers.models.cpu import cpu_kernels, lean_decode
from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.cpu.cpu_speedups import adapters_in_model_dtype, merged_lora_weights, sampling_weights
from workers.models.loading import ATTENTION, HEAD_HOOK, contiguous_head_input, load_model, native_bf16_cpu
from workers.models.lora import apply_lora
from workers.training.sequences import TrainSequence, collate, micro_batches, token_logprobs

PARTS = ("head", "numerics", "decode", "update")
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


def step_sequences(seed: int = 0, prompts: int = 4, group: int = 4) -> list[TrainSequence]:
    """Sequences shaped like a demo step's: 4 prompts x 4 rollouts, each prompt ~93 tokens (the
    demo's system message with its worked example, and the question), then either an answer, or a
    search call, its ~81-token result and an answer (sampled parts capped at 96 tokens per turn)."""
    rng = random.Random(seed)
    sequences = []
    for _ in range(prompts):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(85, 100))]
        for _ in range(group):
            parts = [(rng.randint(10, 96), 1)]
            if rng.random() < 0.6:
                parts += [(rng.randint(60, 110), 0), (rng.randint(10, 96), 1)]
            mask = [0] * len(prompt) + [flag for length, flag in parts for _ in range(length)]
            ids = prompt + [rng.randrange(100, 40000) for _ in range(len(mask) - len(prompt))]
            sequences.append(TrainSequence(ids, mask, [-1.0] * len(ids), rng.uniform(-1, 1)))
    return sequences


def update_round(policy: Any, sequences: list[TrainSequence], pad: int, *, by_length: bool, shared: bool,
                 forward: Any) -> dict[str, float]:
    """Forward and backward over every micro-batch, as the trainer's update does (no optimizer step)."""
    groups = micro_batches(sequences, 2048, by_length=by_length, by_prompt=shared)
    batches = [collate(group, pad, torch.device("cpu"), share_prefix=shared) for group in groups]
    fed = sum(b.input_ids.numel() + (b.prefix_ids.numel() if b.prefix_ids is not None else 0) for b in batches)
    real = sum(len(s.token_ids) for s in sequences)
    started = time.perf_counter()
    for batch in batches:
        new = forward(policy, batch, 1.0)
        (new * batch.loss_mask * batch.advantages).sum().backward()
    seconds = time.perf_counter() - started
    policy.zero_grad(set_to_none=True)
    return {"seconds": seconds, "tokens_fed": fed, "of_real_tokens": fed / real, "micro_batches": len(groups)}


@contextlib.contextmanager
def our_kernels(on: bool) -> Any:
    """Inside the block, our CPU kernels are used (on) or torch's ops are (cpu_kernels.DISABLE)."""
    os.environ[cpu_kernels.DISABLE] = "1" if on else "0"
    try:
        yield
    finally:
        os.environ.pop(cpu_kernels.DISABLE)


UPDATE_PATHS = {  # label: (sorted by length, shared prompts, the update's forward, our kernels)
    "old: arrival order, every position's logits, float32 adapters": (False, False, baseline.token_logprobs, False),
    "sorted by length": (True, False, baseline.token_logprobs, False),
    "sorted, sampled positions' logits, adapters in bf16": (True, False, token_logprobs, False),
    "that, and a prompt's rollouts share its forward": (True, True, token_logprobs, False),
    "new: that, on our kernels (norm, attention backward)": (True, True, token_logprobs, True),
}


def update_comparison(policy: Any, pad: int, repeats: int) -> dict[str, Any]:
    """The update's forward+backward on 16 sequences shaped like a demo step's, with adapters that
    are not zero (as after a few steps), old and new paths alternating."""
    sequences = step_sequences()
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in UPDATE_PATHS}
    for _ in range(repeats):
        for label, (by_length, shared, forward, kernels) in UPDATE_PATHS.items():
            with our_kernels(kernels):
                runs[label].append(update_round(policy, sequences, pad, by_length=by_length, shared=shared,
                                                forward=forward))
    medians = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    old = medians[next(iter(UPDATE_PATHS))]["seconds"]
    print("| update, 16 demo-step sequences | micro-batches | tokens fed / tokens | forward+backward | vs old |")
    print("|---|---|---|---|---|")
    for label, m in medians.items():
        print(f"| {label} | {m['micro_batches']:.0f} | {m['of_real_tokens']:.2f} | {m['seconds']:.2f} s | "
              f"{m['seconds'] / old:.2f} |")
    return {"runs": runs, "medians": medians}


def memory_bandwidth_gbs(repeats: int) -> float:
    """Bytes a 256 MB copy reads and writes per second (median): what bounds decoding at small batch."""
    source = torch.empty(2**28, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    times = [timed(lambda: target.copy_(source))[0] for _ in range(max(repeats, 3))]
    return 2 * source.numel() / statistics.median(times) / 1e9


DECODE_PATHS = ("old", "new", "new, sampling weights, no kernels", "new, sampling weights, no lean step",
                "new, sampling weights")


def decode_comparison(policy: Any, tokenizer: Any, repeats: int) -> dict[str, Any]:
    """Decode tokens/s at batch 16, 48 new tokens after a 300-token prompt (distinct prompts, so no
    prefill is shared): the generator before continuous batching (baseline_generation) with
    transformers' sdpa attention, against DecodeBatch with the packed decode attention
    (models.packed_decode_attention), on the model as it is and on the weights the rollout engine
    samples on (models.sampling_weights: LoRA merged, linear layers packed for oneDNN, our kernels,
    the lean decode step; each of the last two left out once), alternating; once with prompts of one length (no mask), once
    with 285-315 tokens (rows padded, a mask, as in training); and the machine's limit, the weights
    read once per decode step."""
    ids = tokenizer.encode(TEXT * 40)
    shapes = {"300 tokens each": [300] * ROWS, "285-315 tokens": [285 + 2 * i for i in range(ROWS)]}
    pad = tokenizer.pad_token_id
    runs: dict[str, dict[str, list[float]]] = {shape: {path: [] for path in DECODE_PATHS} for shape in shapes}
    identical: dict[str, bool] = {}
    lean_identical: dict[str, bool] = {}
    for _ in range(repeats):
        for shape, lengths in shapes.items():
            batch = [GenerationRequest(context_ids=ids[i: n + i], max_new_tokens=NEW_TOKENS, seed=i)
                     for i, n in enumerate(lengths)]
            tokens = {}
            for path in DECODE_PATHS:
                tokens[path] = decode_run(policy, batch, pad, path, runs[shape][path])
            identical[shape] = tokens["old"] == tokens["new"]
            lean_identical[shape] = tokens["new, sampling weights"] == tokens["new, sampling weights, no lean step"]
    policy.get_base_model().set_attn_implementation(ATTENTION)
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    bandwidth = memory_bandwidth_gbs(repeats)
    limit = ROWS * bandwidth * 1e9 / weights
    cache = {shape: kv_cache_bytes(policy, lengths) for shape, lengths in shapes.items()}
    with_cache = {shape: ROWS * bandwidth * 1e9 / (weights + cache[shape]) for shape in shapes}
    medians = {shape: {path: statistics.median(v) for path, v in r.items()} for shape, r in runs.items()}
    print("| decode, batch 16, 48 tokens after | path | tokens/s | vs old | of the bandwidth limit | "
          "of the limit with the KV cache |\n|---|---|---|---|---|---|")
    for shape, m in medians.items():
        for path in DECODE_PATHS:
            print(f"| {shape} | {path} | {m[path]:.0f} | {m[path] / m['old']:.2f} | {m[path] / limit:.0%} | "
                  f"{m[path] / with_cache[shape]:.0%} |")
    print(f"limit: {weights / 1e6:.0f} MB of weights per step at {bandwidth:.1f} GB/s (copy, this run) = "
          f"{limit:.0f} tokens/s at batch 16; with the KV cache each step also reads "
          f"({', '.join(f'{shape}: {b / 1e6:.0f} MB' for shape, b in cache.items())}): "
          f"{', '.join(f'{v:.0f}' for v in with_cache.values())} tokens/s; "
          f"old and new (unmerged) bf16 tokens identical: {identical} (the "
          "packed attention rounds differently); the lean step's tokens and log-probs the same as the model's "
          f"forward on the same weights: {lean_identical}\n")
    return {"runs": runs, "medians": medians, "weights_mb": weights / 1e6, "bandwidth_gbs": bandwidth,
            "limit_tokens_per_s": limit, "kv_cache_mb": {k: v / 1e6 for k, v in cache.items()},
            "limit_with_kv_cache_tokens_per_s": with_cache, "identical_old_new": identical, "identical_lean_model": lean_identical}


def kv_cache_bytes(policy: Any, lengths: list[int]) -> float:
    """Bytes of KV cache a decode step reads, averaged over the NEW_TOKENS steps after these prompts."""
    config = policy.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # keys and values, bf16
    return per_token * sum(n + NEW_TOKENS / 2 for n in lengths)


def decode_run(policy: Any, batch: list[GenerationRequest], pad: int, path: str, rates: list[float]) -> list[Any]:
    """One generation on `path`; appends its decode tokens/s to `rates`, returns tokens and log-probs."""
    policy.get_base_model().set_attn_implementation("sdpa" if path == "old" else ATTENTION)
    timings: dict[str, float] = {}
    if path == "old":
        old_batch = [baseline.GenerationRequest(r.context_ids, r.max_new_tokens, r.seed) for r in batch]
        out = baseline.generate_batch(policy, old_batch, pad_token_id=pad, temperature=1.0, timings=timings)
    else:
        with our_kernels(not path.endswith("no kernels")), \
                sampling_weights(policy) if "sampling weights" in path else contextlib.nullcontext():
            if path.endswith("no lean step"):
                lean_decode.register(policy, None)
            out = generate_batch(policy, batch, pad_token_id=pad, temperature=1.0, timings=timings)
    rates.append(ROWS * (NEW_TOKENS - 1) / timings["decode_s"])
    return [(o.token_ids, o.logprobs) for o in out]


def as_if_trained(policy: Any, std: float = 0.003) -> Any:
    """LoRA B matrices drawn from N(0, std), seeded: adapters that change the model (B starts at
    zero, where merging and the adapter path cost nothing to get right), about their size after a
    few demo steps at the demo's learning rate."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return policy


def numerics(policy: Any, tokenizer: Any) -> dict[str, float]:
    """Mean |log p - log p(float32)| of each token of a demo-like text (a report, a tool call, an
    answer) on the bf16 paths, against a float32 copy of the same weights: adapters unmerged in
    float32 (peft's default), adapters in bf16 (the update), merged weights (sampling)."""
    text = TEXT * 3 + '<tool_call>{"name": "search", "arguments": {"query": "ACME revenue 2022"}}</tool_call> $713,837.'
    ids = torch.tensor([tokenizer.encode(text)])

    def logprobs(model: Any) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)

    truth = logprobs(copy.deepcopy(policy).float())
    unmerged = logprobs(policy)
    with adapters_in_model_dtype(policy):
        in_bf16 = logprobs(policy)
    with merged_lora_weights(policy):
        merged = logprobs(policy)
    out = {"adapters unmerged, float32": float((unmerged - truth).abs().mean()),
           "adapters in bf16 (update)": float((in_bf16 - truth).abs().mean()),
           "merged weights (sampling)": float((merged - truth).abs().mean()),
           "merged vs unmerged": float((merged - unmerged).abs().mean())}
    print("| bf16 log-probs, LoRA B ~ N(0, 0.003) | mean abs difference to float32 |\n|---|---|")
    for label, value in out.items():
        print(f"| {label} | {value:.4f} |")
    print()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which comparisons, comma-separated (default all: {','.join(PARTS)})")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    dtype = "bfloat16" if native_bf16_cpu() or torch.cuda.is_available() else "float32"
    loaded = load_model(MODEL, dtype=dtype)
    policy = as_if_trained(apply_lora(loaded, rank=16, alpha=32).eval())
    batch = requests(loaded.tokenizer)
    pad = loaded.tokenizer.pad_token_id
    out: dict[str, Any] = {"model": MODEL, "dtype": dtype, "rows": ROWS, "new_tokens": NEW_TOKENS,
                           "repeats": args.repeats, "torch_threads": torch.get_num_threads()}
    if "head" in parts:
        out.update(head_comparison(policy, loaded, batch, pad, args.repeats))
    if "numerics" in parts:
        out["numerics"] = numerics(policy, loaded.tokenizer)
    if "decode" in parts:
        out["decode"] = decode_comparison(policy, loaded.tokenizer, args.repeats)
    if "update" in parts:
        out["update"] = update_comparison(policy, pad, args.repeats)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


def head_comparison(policy: Any, loaded: Any, batch: list[GenerationRequest], pad: int, repeats: int
                    ) -> dict[str, Any]:
    """Sampling with a contiguous input to the output layer against the hook removed."""
    head = loaded.model.get_output_embeddings()
    prefill_ids = torch.tensor([r.context_ids[:440] for r in batch])

    def use(path: str) -> None:
        if path == "old" and hasattr(head, HEAD_HOOK):
            getattr(head, HEAD_HOOK).remove()
            delattr(head, HEAD_HOOK)
        elif path == "new":
            contiguous_head_input(loaded.model)

    times: dict[str, dict[str, list[float]]] = {p: {"generation_s": [], "prefill_s": []} for p in ("old", "new")}
    outputs: dict[str, Any] = {}
    with torch.inference_mode():
        for _ in range(repeats):
            for path in ("old", "new"):
                use(path)
                seconds, out = timed(lambda: generate_batch(policy, batch, pad_token_id=pad, temperature=1.0))
                times[path]["generation_s"].append(seconds)
                outputs[path] = [(o.token_ids, o.logprobs) for o in out]
                seconds, _ = timed(lambda: policy(input_ids=prefill_ids, logits_to_keep=1))
                times[path]["prefill_s"].append(seconds)
            hidden = torch.randn(ROWS, 440, head.in_features, dtype=head.weight.dtype)
            for path, view in (("old", hidden[:, -1:, :]), ("new", hidden[:, -1:, :].contiguous())):
                use("old")  # the layer alone, fed each input as it comes
                seconds, _ = timed(lambda: head(view))
                times[path].setdefault("output_layer_s", []).append(seconds)
    use("new")
    medians = {p: {k: statistics.median(v) for k, v in m.items()} for p, m in times.items()}
    identical = outputs["old"] == outputs["new"]
    out = {"runs": times, "medians": medians,
           "ratio_new_over_old": {k: medians["new"][k] / medians["old"][k] for k in medians["new"]},
           "tokens_and_logprobs_identical": identical}
    print("| measure (LoRA SmolLM2, 16 rows) | old | new | new / old |\n|---|---|---|---|")
    for key, label in (("output_layer_s", "output layer on the last positions of 16 x 440"),
                       ("prefill_s", "prefill of 16 x 440 tokens"), ("generation_s", "generation: prompt + 48 tokens")):
        print(f"| {label} | {medians['old'][key]:.2f} s | {medians['new'][key]:.2f} s | "
              f"{out['ratio_new_over_old'][key]:.2f} |")
    print(f"tokens and log-probs identical: {identical}\n")
    return out


if __name__ == "__main__":
    main()
