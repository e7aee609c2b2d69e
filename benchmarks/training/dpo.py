"""One DPO training step: our DPO trainer against TRL's DPOTrainer, on the CPU, side by side.

Both train SmolLM2-135M-Instruct (a fresh `load_model(..., dtype="float32", device="cpu")` per
side) with LoRA r=16 / alpha=32 on q/k/v/o (the same LoraConfig as `training_mode`), the sigmoid
DPO loss with beta 0.1, AdamW lr 1e-5 with no weight decay, gradient clipping at 1.0, no dropout,
no gradient checkpointing, on the same `--pairs` agent-style preference pairs, all of them in one
optimizer step (TRL: per_device_train_batch_size = pairs, gradient_accumulation_steps = 1).

A pair's conversation is a question, a `search` tool call and its ~300-character result; the
preferred answer states the figure, the non-preferred one searches again. Ours renders the rows
with `pairs_from_rows`. SmolLM2's chat template ignores `tools` and `tool_calls`, so TRL gets the
same conversation as our formatter hands the template (tool schemas in the system message, the
call as its <tool_call> text, the result as a <tool_response> user turn); the token ids are
checked against ours and the counts reported.

Three rows:
- ours: `DpoTrainer`'s update (the reference log-probs scored once at setup, so a step is one
  forward and backward of the policy over both answers); the reference pass is timed on its own
  and reported per pair;
- TRL default: a step also runs the reference forward (the LoRA adapter disabled);
- TRL with `precompute_ref_log_probs=True`: the reference scored once before training, like ours.

Time per step: the median of `--steps` steps after one warm-up step (ours: the update call; TRL:
on_step_begin → on_step_end of a TrainerCallback). Memory: each row runs in its own subprocess;
peak RSS is that process's ru_maxrss (imports, model, reference pass and steps), "RSS@step1" its
resident set (psutil) before the first step, "added" the difference.

    .venv/bin/python -m benchmarks.training.dpo [--pairs 8] [--steps 3]

Needs TRL (`pip install trl==1.16.0`, the `bench` extra); without it only ours is measured.
Prints a table and writes benchmarks/results/training_dpo.json. Target: ours/TRL time per
step ≤ 0.5 (against TRL's default step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.training.run import (CHILD_TIMEOUT_S, LORA_ALPHA, LORA_RANK, LORA_TARGETS, REPO, SEED,
                                     _torch_threads, _trl_version, peak_rss_mb, rss_mb, trl_missing_reason)

RESULTS = REPO / "benchmarks" / "results" / "training_dpo.json"
MODEL = "SmolLM2-135M-Instruct"
TARGET_RATIO = 0.5
BETA, LEARNING_RATE, MAX_GRAD_NORM = 0.1, 1e-5, 1.0
MAX_LENGTH = 4096  # our max_seq_tokens default; no pair comes near it, so neither side truncates
SIDES = {"ours": "agent-rft DPO", "trl": "TRL DPOTrainer", "trl_precomputed": "TRL, precomputed ref"}

COMPANIES = ["Acme Robotics", "Borealis Foods", "Cobalt Freight", "Dunmore Textiles", "Everline Health",
             "Fjord Energy", "Granite Telecom", "Halcyon Games"]
SYSTEM = "You are a research assistant. Use the search tool to find facts, then answer in one sentence."
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search company filings and news; returns the best matching passage.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look for"}},
                   "required": ["query"]}}}


# --- the preference pairs -------------------------------------------------------------------------


def _search_call(call_id: str, query: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": query})}}


def preference_row(i: int) -> dict[str, Any]:
    """An OpenAI preference row: the answer that uses the search result against another search."""
    company, year = COMPANIES[i % len(COMPANIES)], 2015 + i % 9
    revenue = f"${1.3 + 0.7 * i:.1f} billion"
    result = (f"{company} annual report {year}, financial highlights. Total revenue for fiscal {year} was "
              f"{revenue}, up from the prior year on higher volumes in its core segments. Operating margin "
              f"improved by 1.8 points; net income rose 12 percent. The company ended the year with 4,200 "
              f"employees and reaffirmed its outlook for {year + 1}.")
    first = _search_call(f"call_{i}a", f"{company} revenue {year}")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What was {company}'s revenue in {year}?"},
                {"role": "assistant", "content": "", "tool_calls": [first]},
                {"role": "tool", "tool_call_id": f"call_{i}a", "content": result}]
    answer = f"{company}'s revenue in {year} was {revenue}, according to its annual report."
    again = _search_call(f"call_{i}b", f"{company} {year} annual revenue figure")
    return {"input": {"messages": messages, "tools": [SEARCH_TOOL]},
            "preferred_output": [{"role": "assistant", "content": answer}],
            "non_preferred_output": [{"role": "assistant", "content": "", "tool_calls": [again]}]}


def trl_example(formatter: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The row as TRL's conversational prompt/chosen/rejected. SmolLM2's template would drop the
    tool schemas and the tool call, so TRL gets the conversation as our formatter prepares it for
    the template: the same text, hence (checked) the same tokens."""
    from workers.engine.toolcalls import as_tool_schemas

    tools = row["input"]["tools"]
    prompt = formatter._prepare(row["input"]["messages"], as_tool_schemas(tools))  # noqa: SLF001 - the template's input

    def turn(name: str) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": formatter.assistant_turn_text(row[name][0])}]

    # tools as JSON text: TRL passes them to the template (which ignores them), and Arrow would
    # otherwise turn the nested schema into structs padded with nulls.
    return {"prompt": prompt, "chosen": turn("preferred_output"), "rejected": turn("non_preferred_output"),
            "tools": json.dumps(tools)}


def token_counts(prompts: list[int], chosen: list[int], rejected: list[int], learned: int, fed: int) -> dict[str, Any]:
    """A batch's tokens: per-pair means of the prompt and each answer, the tokens carrying loss,
    and the tokens the step's forward passes process (padding included)."""
    n = len(prompts)
    return {"prompt_tokens_per_pair": sum(prompts) / n, "chosen_tokens_per_pair": sum(chosen) / n,
            "rejected_tokens_per_pair": sum(rejected) / n, "learned_tokens_per_step": learned,
            "fed_tokens_per_forward": fed}


# --- the sides ------------------------------------------------------------------------------------


def summarise(step_s: list[float], rss_at_start: float, **extra: Any) -> dict[str, Any]:
    """Median step time over the timed steps (the warm-up step already dropped) and memory."""
    peak = peak_rss_mb()
    return {"step_s": [round(s, 4) for s in step_s], "step_s_median": round(median(step_s), 4),
            "rss_at_first_step_mb": round(rss_at_start, 1), "peak_rss_mb": round(peak, 1),
            "training_added_mb": round(peak - rss_at_start, 1), **extra}


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from workers.methods.dpo.hyperparameters import DpoConfig
    from workers.methods.dpo.loss import pair_batches, reference_logprobs
    from workers.methods.dpo.trainer import DpoTrainer
    from workers.models.loading import load_model
    from workers.training.sequences import padded_cost

    config = DpoConfig(batch_size=args.pairs, n_epochs=1, learning_rate=LEARNING_RATE, eval_interval=1, beta=BETA,
                       lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, max_seq_tokens=MAX_LENGTH,
                       max_grad_norm=MAX_GRAD_NORM, seed=SEED)
    rows = [preference_row(i) for i in range(args.pairs)]
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        trainer = DpoTrainer(loaded=load_model(MODEL, dtype="float32", device="cpu"), config=config,
                             train_rows=rows, valid_rows=[], work_dir=Path(tmp), hooks=None)
        trainer._setup()  # noqa: SLF001 - renders the pairs, wraps the model in LoRA, scores the reference
        pairs = trainer.train.pairs
        # The reference pass alone, timed again on the still untrained weights (setup also renders
        # and wraps); it runs once per job, so it is reported per pair, not per step.
        started = time.perf_counter()
        reference_logprobs(trainer.model, pairs, pad_token_id=trainer.pad_token_id,
                           micro_batch_tokens=config.micro_batch_tokens)
        reference_s = time.perf_counter() - started
        rss_at_start, step_s, losses = rss_mb(), [], []
        for _ in range(args.steps + 1):
            started = time.perf_counter()
            # The step's work; _train_step adds only the batch choice and the metrics event.
            scores = trainer._update(pairs)  # noqa: SLF001
            step_s.append(time.perf_counter() - started)
            losses.append(round(scores.means()["loss"], 5))
    batches = pair_batches(pairs, config.micro_batch_tokens)
    fed = sum(padded_cost([s for p in b for s in (p.chosen, p.rejected)], shared=True) for b in batches)
    prompts = [p.chosen.loss_mask.index(1) for p in pairs]  # the answer starts at its first learned token
    tokens = token_counts(prompts, [len(p.chosen.token_ids) - n for p, n in zip(pairs, prompts)],
                          [len(p.rejected.token_ids) - n for p, n in zip(pairs, prompts)],
                          sum(sum(s.loss_mask) for p in pairs for s in (p.chosen, p.rejected)), fed)
    return summarise(step_s[1:], rss_at_start, loss=losses, micro_batches=len(batches),
                     reference_s=round(reference_s, 4), reference_s_per_pair=round(reference_s / len(pairs), 4),
                     **tokens)


def run_trl(args: argparse.Namespace, precompute: bool) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from workers.engine.prompting import ChatFormatter
    from workers.methods.dpo.data import pairs_from_rows
    from workers.models.loading import load_model

    class StepTimer(TrainerCallback):
        """on_step_begin → on_step_end: the loss (with the reference forward unless precomputed),
        backward, clipping and the optimizer step; setup and logging excluded."""

        def __init__(self) -> None:
            self.durations: list[float] = []
            self.losses: list[float] = []
            self.rss_at_start: float | None = None
            self.started = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if self.rss_at_start is None:
                self.rss_at_start = rss_mb()
            self.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.durations.append(time.perf_counter() - self.started)

        def on_log(self, *_: Any, logs: dict | None = None, **__: Any) -> None:  # after on_step_end: not timed
            if logs and "loss" in logs:
                self.losses.append(round(logs["loss"], 5))

    precompute_s: list[float] = []

    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, *a: Any, **kw: Any) -> Any:  # runs inside __init__
            started = time.perf_counter()
            dataset = super()._precompute_ref_logps(*a, **kw)
            precompute_s.append(time.perf_counter() - started)
            return dataset

    loaded = load_model(MODEL, dtype="float32", device="cpu")
    formatter = ChatFormatter(loaded.tokenizer)
    rows = [preference_row(i) for i in range(args.pairs)]
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="bench-trl-dpo-") as tmp:
        config = DPOConfig(
            output_dir=tmp, max_steps=args.steps + 1, seed=SEED, per_device_train_batch_size=args.pairs,
            gradient_accumulation_steps=1, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, loss_type=["sigmoid"], beta=BETA, max_length=MAX_LENGTH,
            precompute_ref_log_probs=precompute, disable_dropout=True, gradient_checkpointing=False, use_cpu=True,
            bf16=False, fp16=False, report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
        )
        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 bias="none", task_type="CAUSAL_LM")
        trainer = TimedDPOTrainer(model=loaded.model, args=config, processing_class=loaded.tokenizer,
                                  train_dataset=Dataset.from_list([trl_example(formatter, r) for r in rows]),
                                  peft_config=peft_config, callbacks=[timer])
        data = trainer.train_dataset
        trainer.train()
    ours = pairs_from_rows(rows, formatter, max_tokens=MAX_LENGTH, source="benchmark").pairs
    tokens = trl_tokens(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"], ours)
    extra = {"precompute_s": round(precompute_s[0], 4),
             "precompute_s_per_pair": round(precompute_s[0] / args.pairs, 4)} if precompute_s else {}
    return summarise(timer.durations[1:], timer.rss_at_start, loss=timer.losses, optimizer=str(config.optim),
                     **extra, **tokens)


def trl_tokens(prompts: list[list[int]], chosen: list[list[int]], rejected: list[list[int]],
               ours: list[Any]) -> dict[str, Any]:
    """TRL's token counts as its trainer tokenized them, and how its sequences compare with ours."""
    rows = [p + c for p, c in zip(prompts, chosen)] + [p + r for p, r in zip(prompts, rejected)]
    fed = len(rows) * max(len(r) for r in rows)  # one padded batch: both answers, each with its prompt
    counts = token_counts([len(p) for p in prompts], [len(c) for c in chosen], [len(r) for r in rejected],
                          sum(len(c) + len(r) for c, r in zip(chosen, rejected)), fed)
    our_rows = [p.chosen.token_ids for p in ours] + [p.rejected.token_ids for p in ours]
    # Both end with the turn end (<|im_end|> and a newline); ours learns no loss on that newline, TRL does.
    counts["same_token_ids_as_ours"] = all(list(t) == list(o) for t, o in zip(rows, our_rows))
    return counts


# --- the side-by-side run ---------------------------------------------------------------------------


def run_child(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side in its own process, so that its peak memory is its own."""
    with tempfile.TemporaryDirectory(prefix="bench-dpo-child-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "benchmarks.training.dpo", "--only", side, "--result-file", str(out),
                   "--pairs", str(args.pairs), "--steps", str(args.steps)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
        started, load_before = time.perf_counter(), round(os.getloadavg()[0], 2)
        done = subprocess.run(command, cwd=REPO, env=env, timeout=CHILD_TIMEOUT_S, capture_output=True, text=True,
                              check=False)  # a failure is reported with its stderr below
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the {side} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
        result["process_wall_s"] = round(time.perf_counter() - started, 1)
        result["load_average_1min_before"] = load_before
        result["load_average_1min_after"] = round(os.getloadavg()[0], 2)  # other work on the cores skews the times
        return result


def compare(args: argparse.Namespace) -> dict[str, Any]:
    reason = trl_missing_reason("DPOTrainer")
    rows = {side: ({"skipped": reason} if reason and side != "ours" else run_child(side, args)) for side in SIDES}
    ours = rows["ours"]
    # Over one epoch every pair is scored by the reference once: the step plus its pairs' share.
    ours["step_with_reference_s"] = round(ours["step_s_median"] + ours["reference_s_per_pair"] * args.pairs, 4)
    result: dict[str, Any] = {
        "config": {"model": MODEL, "dtype": "float32", "device": "cpu", "pairs_per_step": args.pairs,
                   "timed_steps": args.steps, "warmup_steps": 1, "loss": "sigmoid", "beta": BETA,
                   "learning_rate": LEARNING_RATE, "max_grad_norm": MAX_GRAD_NORM,
                   "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": LORA_TARGETS},
                   "torch_threads": _torch_threads(), "trl_version": _trl_version(),
                   "memory": "ru_maxrss of each side's own process; RSS@step1 from psutil"},
        **rows, "target_ratio": TARGET_RATIO,
    }
    if reason:
        print(reason, file=sys.stderr)
        return result
    for side in ("trl", "trl_precomputed"):
        result[f"ratio_time_per_step_ours_over_{side}"] = round(ours["step_s_median"] / rows[side]["step_s_median"], 3)
        result[f"ratio_peak_rss_ours_over_{side}"] = round(ours["peak_rss_mb"] / rows[side]["peak_rss_mb"], 3)
    result["ratio_step_with_reference_ours_over_trl"] = round(
        ours["step_with_reference_s"] / rows["trl"]["step_s_median"], 3)
    result["target_met"] = result["ratio_time_per_step_ours_over_trl"] <= TARGET_RATIO
    return result


def print_table(result: dict[str, Any]) -> None:
    header = (f"{'trainer':22} {'s/step':>7} {'ref s/pair':>10} {'prompt':>7} {'chosen':>7} {'rejected':>8} "
              f"{'fed tok':>8} {'peak RSS MB':>12} {'RSS@step1':>10} {'added MB':>9}")
    print(header)
    print("-" * len(header))
    for side, name in SIDES.items():
        row = result[side]
        if "skipped" in row:
            print(f"{name:22} skipped: {row['skipped']}")
            continue
        ref = row.get("reference_s_per_pair", row.get("precompute_s_per_pair"))
        print(f"{name:22} {row['step_s_median']:>7.3f} {'-' if ref is None else f'{ref:.3f}':>10} "
              f"{row['prompt_tokens_per_pair']:>7.1f} {row['chosen_tokens_per_pair']:>7.1f} "
              f"{row['rejected_tokens_per_pair']:>8.1f} {row['fed_tokens_per_forward']:>8} {row['peak_rss_mb']:>12.1f} "
              f"{row['rss_at_first_step_mb']:>10.1f} {row['training_added_mb']:>9.1f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per step (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--only", choices=tuple(SIDES), help=argparse.SUPPRESS)  # one side, in a child
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("pairs", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.only:
        result = run_ours(args) if args.only == "ours" else run_trl(args, precompute=args.only == "trl_precomputed")
        args.result_file.write_text(json.dumps(result))
        return
    result = compare(args)
    print(f"one DPO step, {MODEL} float32 on the CPU ({result['config']['torch_threads']} threads), LoRA: "
          f"{args.pairs} pairs; median of {args.steps} steps after a warm-up; tokens per pair\n")
    print_table(result)
    if "target_met" in result:
        print(f"\nours/TRL time per step: {result['ratio_time_per_step_ours_over_trl']:.3f} "
              f"(target ≤ {TARGET_RATIO}: {'met' if result['target_met'] else 'MISSED'}); "
              f"ours/TRL precomputed: {result['ratio_time_per_step_ours_over_trl_precomputed']:.3f}; "
              f"ours with its pairs' reference pass / TRL: {result['ratio_step_with_reference_ours_over_trl']:.3f}\n"
              f"peak memory ours/TRL: {result['ratio_peak_rss_ours_over_trl']:.3f}, "
              f"ours/TRL precomputed: {result['ratio_peak_rss_ours_over_trl_precomputed']:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
