"""One GRPO training step: our trainer against TRL's GRPOTrainer, on the CPU, side by side.

Both train the same model (tiny-smollm2, the same weights and tokenizer, via
workers.models.load_model) on the same single-turn toy task with the same shape of step:
`--prompts` prompts × `--group` completions each, at most `--max-tokens` sampled tokens per
completion (ours: max_tokens_per_turn = max_tokens_per_rollout; TRL: max_completion_length),
temperature 1, LoRA rank 16 / alpha 32 on q/k/v/o (TRL via peft_config; `--mode full` trains
every weight on both instead), GRPO loss (per-sequence token mean, group std scaling, clip 0.2,
no KL), AdamW, gradient clipping at 1.0, no dropout, no gradient checkpointing (TRL's default is
on; ours has none). The reward is the same code on both sides: text_similarity's fuzzy_match of
the answer against a fixed sentence — a continuous reward, so every group has a reward spread
and both trainers update on every completion (our trainer skips groups without spread, TRL does
not; a binary reward would make the two do different work).

Ours runs as in production: the rollout engine, a real (idle) tool server over HTTP, the
text_similarity grader through grade_many, the state saved after every step.

Measured after one warm-up step, over `--steps` steps (median):
- time per step: ours = sampling + grading + training from the step metrics (timing.step;
  the eval of the last step is left out); TRL = on_step_begin → on_step_end of a
  TrainerCallback (generation, reward, loss, backward, clipping, optimizer step), so setup is
  excluded on both sides;
- tokens/s: sampled completion tokens of the step ÷ its time;
- memory: each trainer runs in its own subprocess so the peaks don't mix; peak RSS is that
  process's ru_maxrss (imports, model, training), and "RSS at step 1" its resident set when
  the first step begins, so the difference is what the training steps added.

    .venv/bin/python -m benchmarks.training.run [--steps 3] [--prompts 8] [--group 4]
                                                [--max-tokens 64] [--mode lora|full]

Needs TRL for the comparison (`pip install trl==1.16.0`, the `bench` extra); without it only
our trainer is measured and TRL's row says why it is missing. Prints a table and writes
benchmarks/results/training.json. Target: ours/TRL time per step ≤ 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "training.json"
MODEL = "tiny-smollm2"
TARGET_RATIO = 0.8
SEED = 0
REFERENCE = "The quick brown fox jumps over the lazy dog."
LEARNING_RATE = {"lora": 1e-5, "full": 1e-6}  # the trainer's base rates (docs/training.md)
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # our default: the attention projections
CHILD_TIMEOUT_S = 600
TRL_VERSION = "1.16.0"


def task_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: repeat after me: {REFERENCE}"}]


def rss_mb() -> float:
    import psutil  # an accelerate dependency, so always there with the trainer's stack

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def summarise(step_s: list[float], tokens: list[int], rss_at_start: float, **extra: Any) -> dict[str, Any]:
    """Median step time and tokens/s over the timed steps (the warm-up step already dropped)."""
    per_step_rate = [t / s for t, s in zip(tokens, step_s)]
    peak = peak_rss_mb()
    return {"step_s": [round(s, 4) for s in step_s], "step_s_median": round(median(step_s), 4),
            "completion_tokens_per_step": tokens, "tokens_per_s_median": round(median(per_step_rate), 1),
            "rss_at_first_step_mb": round(rss_at_start, 1), "peak_rss_mb": round(peak, 1),
            "training_added_mb": round(peak - rss_at_start, 1), **extra}


# --- our trainer ------------------------------------------------------------------------------------


class TimingHooks:
    """The worker's side of the trainer, in memory: keeps the metrics and the RSS at step 1."""

    def __init__(self) -> None:
        self.metrics: list[dict] = []
        self.rss_at_start: float | None = None
        self.control_at: dict[int, float] = {}
        self.saved_at: dict[int, float] = {}
        self.errors: list[str] = []

    async def control(self) -> str:
        step = len(self.control_at) + 1
        self.control_at[step] = time.perf_counter()
        if self.rss_at_start is None:
            self.rss_at_start = rss_mb()
        return "continue"

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
        json.dumps(metrics)  # as the worker would send them
        self.metrics.append(metrics)

    async def on_eval(self, step: int, valid_reward_mean: Any, valid_records: list[dict]) -> None:
        pass

    async def on_checkpoint(self, step: int, path: Path, metrics: dict) -> list[str]:
        return []

    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None:
        self.saved_at[completed_steps] = time.perf_counter()

    async def on_event(self, level: str, message: str, data: dict | None) -> None:
        if level == "error":
            self.errors.append(message)


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from agent_rft.graders.core import GraderContext
    from tests.rl.tool_server import tool_server
    from workers.models.loading import load_model
    from workers.engine.rollout import EngineConfig
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.hyperparameters import TrainingConfig
    from workers.methods.reinforcement.trainer import Trainer

    total_steps = args.steps + 1  # the warm-up step, then the timed ones
    config = TrainingConfig(
        batch_size=args.prompts, n_epochs=total_steps, group_size=args.group,
        learning_rate=LEARNING_RATE[args.mode], eval_interval=total_steps, eval_samples=1, loss="grpo",
        kl_coef=0.0, clip_epsilon=0.2, training_mode=args.mode, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA,
        seed=SEED, engine=EngineConfig(max_tokens_per_turn=args.max_tokens, max_tokens_per_rollout=args.max_tokens,
                                       temperature=1.0, top_p=1.0),
    )
    grader = {"type": "text_similarity", "name": "fuzzy", "input": "{{sample.output_text}}",
              "reference": "{{item.reference}}", "evaluation_metric": "fuzzy_match"}
    rows = [{"messages": task_messages(i), "reference": REFERENCE} for i in range(args.prompts)]
    loaded = load_model(MODEL, device="cpu")
    hooks = TimingHooks()

    async def train(work_dir: Path) -> Any:
        with tool_server() as (url, _):  # single-turn task: the server stays idle, the engine is the real one
            async with ToolClient([{"name": "search", "server_url": url}], allowlist=["127.0.0.1"]) as client:
                trainer = Trainer(loaded=loaded, config=config, train_rows=rows, valid_rows=[], grader=grader,
                                  grader_ctx=GraderContext(), tool_client=client, job_tools=[], work_dir=work_dir,
                                  hooks=hooks)
                return await trainer.run()

    with tempfile.TemporaryDirectory(prefix="bench-ours-") as tmp:
        outcome = asyncio.run(train(Path(tmp)))
    if outcome.status != "succeeded":
        raise RuntimeError(f"our trainer {outcome.status}: {outcome.error}")
    timed = hooks.metrics[1:]
    step_s = [m["timing"]["step"]["full_iteration"] - m["timing"]["step"]["eval"] for m in timed]
    # Control → state saved: the step as a worker lives it (metrics, hooks, state written); the
    # last step also evaluates and checkpoints, so it is left out.
    with_state = [hooks.saved_at[m["step"]] - hooks.control_at[m["step"]] for m in timed[:-1]]
    n_rollouts = args.prompts * args.group
    return summarise(
        step_s, [m["usage"]["completion_tokens"] for m in timed], hooks.rss_at_start,
        sampling_s_median=round(median(m["timing"]["step"]["sampling"] for m in timed), 4),
        grading_s_median=round(median(m["timing"]["step"]["grading"] for m in timed), 4),
        training_s_median=round(median(m["timing"]["step"]["training"] for m in timed), 4),
        step_with_state_save_s_median=round(median(with_state), 4) if with_state else None,
        prompt_tokens_per_completion=timed[0]["usage"]["prompt_tokens"] / n_rollouts,
        rollouts_used=[m["train"]["rollouts_used"] for m in timed],
        reward_mean=[round(m["scores"]["train_reward_mean"], 4) for m in timed],
    )


# --- TRL's GRPOTrainer --------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent_rft.graders.implementations.text_similarity import similarity
    from workers.models.loading import load_model

    class StepTimer(TrainerCallback):
        """Times each optimizer step from on_step_begin to on_step_end: setup and logging excluded."""

        def __init__(self) -> None:
            self.durations: list[float] = []
            self.rss_at_start: float | None = None
            self.started = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if self.rss_at_start is None:
                self.rss_at_start = rss_mb()
            self.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.durations.append(time.perf_counter() - self.started)

    tokens_per_step: list[int] = []
    rewards_per_step: list[float] = []

    def fuzzy_reward(completions: list, completion_ids: list, reference: list, **_: Any) -> list[float]:
        """The same metric as our text_similarity grader (the same function)."""
        rewards = [similarity("fuzzy_match", c[0]["content"], r) for c, r in zip(completions, reference)]
        tokens_per_step.append(sum(len(ids) for ids in completion_ids))  # called once per generation = per step
        rewards_per_step.append(sum(rewards) / len(rewards))
        return rewards

    loaded = load_model(MODEL, device="cpu")
    dataset = Dataset.from_list([{"prompt": task_messages(i), "reference": REFERENCE} for i in range(args.prompts)])
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=args.steps + 1, seed=SEED,
            # TRL's per-device batch counts completions: B prompts × G generations, one generation per step.
            per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
            num_generations=args.group, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0,
            learning_rate=LEARNING_RATE[args.mode], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, loss_type="grpo", scale_rewards="group", beta=0.0, epsilon=0.2, num_iterations=1,
            disable_dropout=True, gradient_checkpointing=False, use_cpu=True, bf16=False, fp16=False,
            report_to="none", save_strategy="no", logging_steps=10**6, dataloader_num_workers=0,
        )
        peft_config = (LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                  bias="none", task_type="CAUSAL_LM") if args.mode == "lora" else None)
        trainer = GRPOTrainer(model=loaded.model, reward_funcs=fuzzy_reward, args=config, train_dataset=dataset,
                              processing_class=loaded.tokenizer, peft_config=peft_config, callbacks=[timer])
        trainer.train()
    prompt_tokens = [len(loaded.tokenizer.apply_chat_template(task_messages(i), add_generation_prompt=True,
                                                              tokenize=True, return_dict=True)["input_ids"])
                     for i in range(args.prompts)]
    return summarise(timer.durations[1:], tokens_per_step[1:], timer.rss_at_start,
                     prompt_tokens_per_completion=sum(prompt_tokens) / len(prompt_tokens),
                     reward_mean=[round(r, 4) for r in rewards_per_step[1:]])


# --- the side-by-side run ---------------------------------------------------------------------------


def run_child(which: str, args: argparse.Namespace) -> dict[str, Any]:
    """One trainer in its own process, so its peak memory is its own."""
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "benchmarks.training.run", "--only", which, "--result-file", str(out),
                   "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
                   "--max-tokens", str(args.max_tokens), "--mode", args.mode]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, timeout=CHILD_TIMEOUT_S, capture_output=True, text=True,
                              check=False)  # a failure is reported with its stderr below
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the {which} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
        result["process_wall_s"] = round(time.perf_counter() - started, 1)
        return result


def trl_missing_reason(trainer: str = "GRPOTrainer") -> str | None:
    """Why TRL's rows are skipped, or None when `from trl import <trainer>` works."""
    advice = f"install the bench extra (pip install 'trl=={TRL_VERSION}') to compare against TRL's {trainer}"
    if importlib.util.find_spec("trl") is None:
        return f"TRL is not installed, so only our trainer was measured: {advice}"
    try:
        getattr(importlib.import_module("trl"), trainer)  # only checking that it imports
    except Exception as exc:  # noqa: BLE001 - any import failure means the same: no TRL row
        return f"TRL is installed but does not import ({type(exc).__name__}: {exc}); {advice}"
    return None


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    header = (f"{'trainer':18} {'s/step':>8} {'tokens/s':>9} {'tok/step':>9} {'peak RSS MB':>12} "
              f"{'RSS@step1 MB':>13} {'added MB':>9}")
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:18} skipped: {row['skipped']}")
            continue
        print(f"{name:18} {row['step_s_median']:>8.3f} {row['tokens_per_s_median']:>9.1f} "
              f"{median(row['completion_tokens_per_step']):>9.0f} {row['peak_rss_mb']:>12.1f} "
              f"{row['rss_at_first_step_mb']:>13.1f} {row['training_added_mb']:>9.1f}")


def compare(args: argparse.Namespace) -> dict[str, Any]:
    ours = run_child("ours", args)
    reason = trl_missing_reason()
    trl = {"skipped": reason} if reason else run_child("trl", args)
    if reason:
        print(reason, file=sys.stderr)
    result: dict[str, Any] = {
        "config": {"model": MODEL, "mode": args.mode, "prompts_per_step": args.prompts, "group_size": args.group,
                   "completions_per_step": args.prompts * args.group, "max_completion_tokens": args.max_tokens,
                   "timed_steps": args.steps, "warmup_steps": 1, "temperature": 1.0, "loss": "grpo",
                   "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": LORA_TARGETS} if args.mode == "lora"
                   else None, "torch_threads": _torch_threads(), "trl_version": _trl_version()},
        "ours": ours, "trl": trl, "target_ratio": TARGET_RATIO,
    }
    if not reason:
        result["ratio_time_per_step_ours_over_trl"] = round(ours["step_s_median"] / trl["step_s_median"], 3)
        result["ratio_tokens_per_s_ours_over_trl"] = round(ours["tokens_per_s_median"] / trl["tokens_per_s_median"], 3)
        result["ratio_peak_rss_ours_over_trl"] = round(ours["peak_rss_mb"] / trl["peak_rss_mb"], 3)
        result["target_met"] = result["ratio_time_per_step_ours_over_trl"] <= TARGET_RATIO
    return result


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _trl_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="sampled tokens per completion (default 64)")
    parser.add_argument("--mode", choices=("lora", "full"), default="lora")
    parser.add_argument("--only", choices=("ours", "trl"), help=argparse.SUPPRESS)  # one trainer, in a child
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("steps", "prompts", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.group < 2:
        parser.error("--group must be at least 2 (GRPO compares the completions of a group)")
    return args


def main() -> None:
    args = parse_args()
    if args.only:
        result = run_ours(args) if args.only == "ours" else run_trl(args)
        args.result_file.write_text(json.dumps(result))
        return
    result = compare(args)
    print(f"one GRPO step, {MODEL} on the CPU ({result['config']['torch_threads']} threads), {args.mode}: "
          f"{args.prompts} prompts × {args.group} completions, ≤ {args.max_tokens} tokens each; "
          f"median of {args.steps} steps after a warm-up\n")
    print_table({"agent-rft Trainer": result["ours"], "TRL GRPOTrainer": result["trl"]})
    if "ratio_time_per_step_ours_over_trl" in result:
        print(f"\nours/TRL time per step: {result['ratio_time_per_step_ours_over_trl']:.3f} "
              f"(target ≤ {TARGET_RATIO}: {'met' if result['target_met'] else 'MISSED'}); "
              f"peak memory ours/TRL: {result['ratio_peak_rss_ours_over_trl']:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
