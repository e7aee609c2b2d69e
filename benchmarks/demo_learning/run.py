"""Does RFT make SmolLM2-135M-Instruct measurably better on the financial-reports task, on the CPU?

Everything runs in-process and for real: the synthetic corpus of examples/financial_reports, its
tool server (search / list / cat) under uvicorn on 127.0.0.1, the demo's grader, the
rollout engine and workers.rl.trainer.Trainer with in-memory hooks. No Celery, no API. Every
setting is the demo's own (examples/financial_reports/demo_config.py, read by `demo_settings`).

The task (examples/financial_reports/demo_task.py): one question per report and line item quoted
in the report's text ("What was X's revenue in 2023?", "... net income ..."), so one `search`
returns a snippet that holds the answer. Train and held-out questions are about DIFFERENT companies.

    .venv/bin/python -m benchmarks.demo_learning.run signal [--samples 30 --k 4]
    .venv/bin/python -m benchmarks.demo_learning.run train [--seeds 0 1 2] [--steps 12] [--model ...]

`signal`: k rollouts of the base model per training question; the shares of questions always
wrong / always right / mixed (only mixed ones carry a GRPO gradient).
`train`: per seed, held-out metrics of the base model, the training run, held-out metrics of the
trained policy (same rollout seeds); prints mean ± spread (half the max-min range) over seeds
and writes benchmarks/results/demo_learning.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the search embedder loads from its package, never the hub

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "demo_learning.json"

def demo_settings() -> dict[str, Any]:
    """The demo's own settings (examples/financial_reports/demo_config.py), in the shape this
    benchmark uses: what the README quotes is what `make demo` runs."""
    from examples.financial_reports.demo_config import DEMO, dtype, grader_spec
    from workers.rl.hyperparameters import group_size_for

    x = DEMO.x_open_model
    return {
        "model": DEMO.model,
        "dtype": dtype(DEMO),
        "task": {"corpus_seed": DEMO.seed, "companies": DEMO.companies, "years": list(DEMO.years),
                 "held_out_companies": DEMO.held_out_companies},
        "system_prompt": DEMO.system_prompt,
        "grader": grader_spec(DEMO.grader, "http://unused.invalid"),
        "engine": {"max_episode_steps": DEMO.max_episode_steps, "max_tokens_per_turn": x["max_tokens_per_turn"],
                   "max_tokens_per_rollout": x["max_tokens_per_rollout"], "temperature": x["temperature"],
                   "top_p": x.get("top_p", 1.0)},
        "training": {"batch_size": DEMO.hyperparameters["batch_size"],
                     "group_size": group_size_for(DEMO.hyperparameters["compute_multiplier"]),
                     "steps": DEMO.steps, "learning_rate": x["learning_rate"], "lora_rank": x["lora_rank"],
                     "lora_alpha": x["lora_alpha"], "loss": x["loss"], "kl_coef": x["kl_coef"],
                     "clip_epsilon": x.get("clip_epsilon", 0.2)},
        "eval": {"rollouts_per_question": 2},
    }


def build_task(settings: dict[str, Any], out_dir: Path) -> tuple[Path, list[dict], list[dict]]:
    from examples.financial_reports import demo_task

    task = settings["task"]
    corpus, train, held_out = demo_task.build(
        out_dir, seed=task["corpus_seed"], companies=task["companies"], years=task["years"],
        held_out_companies=task["held_out_companies"], system_prompt=settings["system_prompt"])
    if task.get("example_turns"):  # a worked example as turns of the conversation, after the system message
        train, held_out = ([{**row, "messages": [row["messages"][0], *task["example_turns"], *row["messages"][1:]]}
                            for row in rows] for rows in (train, held_out))
    return corpus, train, held_out


# --- the pieces of a run --------------------------------------------------------------------------


def tool_endpoints(port: int) -> list[dict[str, Any]]:
    from examples.financial_reports.server import TOOL_SCHEMAS

    return [{"name": t["function"]["name"], "server_url": f"http://127.0.0.1:{port}/tools",
             "description": t["function"]["description"], "parameters": t["function"]["parameters"]}
            for t in TOOL_SCHEMAS]


def engine_config(settings: dict[str, Any]) -> Any:
    from workers.rl.rollout import EngineConfig

    return EngineConfig(**settings["engine"])


def grader(settings: dict[str, Any]) -> Any:
    from pydantic import TypeAdapter

    from app.graders.schemas import Grader

    return TypeAdapter(Grader).validate_python(settings["grader"])


async def rollouts(loaded: Any, client: Any, settings: dict[str, Any], rows: list[dict], k: int,
                   seed: int) -> list[dict[str, Any]]:
    """k graded rollouts per row; the seeds depend on (seed, row, k) only, so before and after
    training see the same draws."""
    from app.graders.core import GraderContext
    from examples.financial_reports.server import TOOL_SCHEMAS
    from workers.rl.prompting import ChatFormatter
    from workers.rl.rollout import RolloutEngine, RolloutSpec
    from workers.rl.toolcalls import ToolSchema
    from workers.rl.data import rollout_seed
    from workers.rl.grading import grade_rollouts

    schemas = [ToolSchema.from_openai(t) for t in TOOL_SCHEMAS]
    specs = [RolloutSpec(i, row["messages"], schemas, {key: v for key, v in row.items() if key != "messages"},
                         seed=rollout_seed(seed, "bench", i, j)) for i, row in enumerate(rows) for j in range(k)]
    engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client,
                           engine_config(settings))
    records = await engine.run(specs)
    graded = await grade_rollouts(grader(settings), GraderContext(), records, [s.item for s in specs])
    return [{"row": s.sample_index, "reward": g.reward or 0.0, **sub_rewards(g), "tool_calls": len(g.record.tool_calls),
             "tools": [call.name for call in g.record.tool_calls], "tool_output_tokens": g.record.tool_output_tokens,
             "tokens": g.record.completion_tokens, "seconds": g.record.wall_time_s,
             "finish": g.record.finish_reason, "answer": g.record.final_answer, "messages": g.record.messages}
            for s, g in zip(specs, graded)]


def sub_rewards(graded: Any) -> dict[str, float]:
    """`correct` (numeric_match) and `searched`; a plain numeric_match grader has only `correct`."""
    subs = (graded.grade.result.sub_rewards or {}) if graded.grade else {}
    if not subs:
        return {"correct": graded.reward or 0.0}
    return {key: float(value) for key, value in subs.items()}


def metrics(results: list[dict[str, Any]]) -> dict[str, float]:
    return {"accuracy": mean(r["correct"] for r in results),
            "reward": mean(r["reward"] for r in results),
            "searched_for_company": mean(r.get("searched", 0.0) for r in results),
            "tool_calls_per_rollout": mean(r["tool_calls"] for r in results),
            **{f"{name}_calls_per_rollout": mean(r.get("tools", []).count(name) for r in results)
               for name in ("search", "list", "cat")},
            "tool_output_tokens_per_rollout": mean(r.get("tool_output_tokens", 0) for r in results),
            "tokens_per_rollout": mean(r["tokens"] for r in results),
            "seconds_per_rollout": mean(r["seconds"] for r in results),
            "answered_rate": mean(r["finish"] == "answered" for r in results)}


def signal_shares(results: list[dict[str, Any]]) -> dict[str, float]:
    by_row: dict[int, list[float]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r["reward"])
    kinds = ["always_0" if max(v) == 0 else "always_1" if min(v) == 1 else "mixed" for v in by_row.values()]
    return {kind: kinds.count(kind) / len(kinds) for kind in ("always_0", "always_1", "mixed")}


class QuietHooks:
    """The trainer's reporting channel, kept in memory; prints one line per step and stops the run
    after `max_steps` (the trainer counts steps in epochs, the benchmark in steps)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.metrics: list[dict] = []

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
        self.metrics.append(metrics)
        t, timing = metrics["train"], metrics["timing"]["step"]
        correct = (metrics["scores"].get("train_sub_rewards") or {}).get("correct")
        print(f"  step {step}/{metrics['total_steps']}: reward {metrics['scores']['train_reward_mean']:.3f} "
              + (f"correct {correct:.3f} " if correct is not None else "") +
              f"mixed groups {1 - t['frac_reward_zero_std']:.2f} tool calls "
              f"{metrics['tools'].get('tool_calls_per_rollout', 0):.2f} "
              f"sampling {timing['sampling']:.1f}s training {timing['training']:.1f}s "
              f"step {timing['full_iteration']:.1f}s", flush=True)

    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict]) -> None: ...

    async def on_checkpoint(self, step: int, path: Path, metrics: dict) -> list[str]:
        return []

    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None: ...

    async def control(self) -> str:
        return "cancel" if len(self.metrics) >= self.max_steps else "continue"

    async def on_event(self, level: str, message: str, data: dict | None) -> None:
        if level != "info":
            print(f"  [{level}] {message}", flush=True)


def training_config(settings: dict[str, Any], n_train: int, seed: int) -> Any:
    from workers.rl.hyperparameters import TrainingConfig

    t = settings["training"]
    n_epochs = math.ceil(t["steps"] * t["batch_size"] / n_train)  # at least `steps`; the hooks stop there
    return TrainingConfig(
        batch_size=t["batch_size"], n_epochs=n_epochs, group_size=t["group_size"], learning_rate=t["learning_rate"],
        eval_interval=10_000, eval_samples=1, loss=t["loss"], kl_coef=t["kl_coef"], clip_epsilon=t["clip_epsilon"],
        training_mode="lora", lora_rank=t["lora_rank"], lora_alpha=t["lora_alpha"], engine=engine_config(settings),
        seed=seed)


async def train_one_seed(settings: dict[str, Any], port: int, train_rows: list[dict], held_out: list[dict],
                         seed: int, work_dir: Path) -> dict[str, Any]:
    from app.graders.core import GraderContext
    from workers.rl.models import load_model
    from workers.rl.tools_client import ToolClient
    from workers.rl.trainer import Trainer

    loaded = load_model(settings["model"], dtype=settings["dtype"])
    k = settings["eval"]["rollouts_per_question"]
    async with ToolClient(tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        before = await rollouts(loaded, client, settings, held_out, k, seed=1000 + seed)
        print(f"seed {seed}: base held-out {metrics(before)}", flush=True)
        config = training_config(settings, len(train_rows), seed)
        config = replace(config, eval_interval=10_000 * config.n_epochs)
        hooks = QuietHooks(settings["training"]["steps"])
        trainer = Trainer(loaded=loaded, config=config, train_rows=train_rows, valid_rows=held_out[:1],
                          grader=grader(settings), grader_ctx=GraderContext(), tool_client=client,
                          job_tools=tool_endpoints(port), work_dir=work_dir, hooks=hooks)
        started = time.perf_counter()
        outcome = await trainer.run()
        train_seconds = time.perf_counter() - started
        if len(hooks.metrics) < settings["training"]["steps"]:
            raise RuntimeError(f"training failed: {outcome.error}")
        after = await rollouts(loaded, client, settings, held_out, k, seed=1000 + seed)  # LoRA is in loaded.model
        print(f"seed {seed}: trained held-out {metrics(after)}", flush=True)
    steps = [m["timing"]["step"]["full_iteration"] for m in hooks.metrics]
    return {"seed": seed, "before": metrics(before), "after": metrics(after), "train_seconds": train_seconds,
            "steps": len(steps), "step_seconds_mean": mean(steps),
            "train_reward_curve": [m["scores"]["train_reward_mean"] for m in hooks.metrics],
            "train_correct_curve": [(m["scores"].get("train_sub_rewards") or {}).get("correct") for m in hooks.metrics],
            "mixed_group_share_curve": [1 - m["train"]["frac_reward_zero_std"] for m in hooks.metrics]}


def spread(values: list[float]) -> tuple[float, float]:
    return mean(values), (max(values) - min(values)) / 2


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| metric (held-out) | base | trained |", "|---|---|---|"]
    for key in ("accuracy", "reward", "searched_for_company", "tool_calls_per_rollout", "tokens_per_rollout", "seconds_per_rollout", "answered_rate"):
        b, a = spread([r["before"][key] for r in runs]), spread([r["after"][key] for r in runs])
        lines.append(f"| {key} | {b[0]:.3f} ± {b[1]:.3f} | {a[0]:.3f} ± {a[1]:.3f} |")
    t, s = spread([r["train_seconds"] for r in runs]), spread([r["step_seconds_mean"] for r in runs])
    lines.append(f"| training time (s) | | {t[0]:.0f} ± {t[1]:.0f} ({runs[0]['steps']} steps, "
                 f"{s[0]:.1f} ± {s[1]:.1f} s/step) |")
    return "\n".join(lines)


# --- commands -------------------------------------------------------------------------------------


def serve_tools(stack: ExitStack, corpus: Path, cache: Path, *, suggest_cat: bool = False) -> int:
    from examples.financial_reports.server import create_app
    from tests.conftest import serve_app

    return stack.enter_context(serve_app(create_app(corpus, index_cache_dir=cache, suggest_cat=suggest_cat)))


async def measure_signal(settings: dict[str, Any], port: int, rows: list[dict], k: int) -> dict[str, Any]:
    from workers.rl.models import load_model
    from workers.rl.tools_client import ToolClient

    loaded = load_model(settings["model"], dtype=settings["dtype"])
    async with ToolClient(tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        started = time.perf_counter()
        results = await rollouts(loaded, client, settings, rows, k, seed=0)
        elapsed = time.perf_counter() - started
    for r in results[: 3 * k]:
        print(f"  row {r['row']} reward {r['reward']} calls {r['tool_calls']} {r['finish']}: {r['answer'][:100]!r}")
    sequences = Counter(" ".join(r["tools"]) or "(no call)" for r in results)
    return {"samples": len(rows), "k": k, "shares": signal_shares(results), "metrics": metrics(results),
            "tool_sequences": dict(sequences.most_common(6)),
            "finish_reasons": dict(Counter(r["finish"] for r in results)),
            "wall_seconds": elapsed}


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["signal", "train"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--model")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the demo's 2 cores)")
    parser.add_argument("--system-prompt", type=Path, help="a file whose text replaces the demo's system prompt")
    parser.add_argument("--example-turns", type=Path,
                        help="a JSON list of chat messages (a worked example as conversation turns) put before each question")
    parser.add_argument("--max-episode-steps", type=int, help="tool calls per rollout")
    parser.add_argument("--max-tokens-per-turn", type=int)
    parser.add_argument("--max-tokens-per-rollout", type=int)
    parser.add_argument("--search-suggests-cat", action="store_true",
                        help="search's output ends with the cat call of its top hit, as a <tool_call> block to copy")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = demo_settings()
    overrides = {"model": args.model, "engine.temperature": args.temperature, "training.steps": args.steps,
                 "training.learning_rate": args.learning_rate, "training.batch_size": args.batch_size,
                 "engine.max_episode_steps": args.max_episode_steps, "engine.max_tokens_per_turn": args.max_tokens_per_turn,
                 "engine.max_tokens_per_rollout": args.max_tokens_per_rollout,
                 "system_prompt": args.system_prompt.read_text().strip() if args.system_prompt else None,
                 "task.example_turns": json.loads(args.example_turns.read_text()) if args.example_turns else None}
    for path, value in overrides.items():
        if value is not None:
            *parents, key = path.split(".")
            target = settings
            for parent in parents:
                target = target[parent]
            target[key] = value
    with tempfile.TemporaryDirectory(prefix="demo-learning-") as tmp, ExitStack() as stack:
        corpus, train_rows, held_out = build_task(settings, Path(tmp) / "data")
        port = serve_tools(stack, corpus, Path(tmp) / "index", suggest_cat=args.search_suggests_cat)
        print(f"{len(train_rows)} training questions, {len(held_out)} held-out questions", flush=True)
        if args.command == "signal":
            report = asyncio.run(measure_signal(settings, port, train_rows[: args.samples], args.k))
            print(json.dumps(report, indent=2))
            out = {"signal": report, "settings": settings}
        else:
            runs = []
            for seed in args.seeds:
                runs.append(asyncio.run(train_one_seed(settings, port, train_rows, held_out, seed,
                                                       Path(tmp) / f"run-{seed}")))
                save("train", merged_runs(settings, runs))  # each seed as soon as it is done
            out = merged_runs(settings, runs)
            print(out["table"])
    if args.command == "signal":
        save("signal", out)
    print(f"wrote {RESULTS}")


def merged_runs(settings: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """This invocation's seeds plus those of earlier invocations WITH THE SAME SETTINGS (a seed
    run again replaces its earlier run), so `--seeds 1 2` after `--seeds 0` reports all three."""
    previous = load().get("train", {})
    kept = {r["seed"]: r for r in previous.get("runs", [])} if previous.get("settings") == settings else {}
    kept.update({r["seed"]: r for r in runs})
    merged = [kept[seed] for seed in sorted(kept)]
    return {"runs": merged, "seeds": sorted(kept), "settings": settings, "table": table(merged)}


def load() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def save(command: str, out: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**load(), command: out}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
