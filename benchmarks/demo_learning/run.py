"""Does the demo teach Agent RFT's lesson on the CPU: fewer tool calls and tokens, better answers?

Everything runs in-process and for real, with exactly the demo's settings
(examples/financial_reports/demo_config.py, read by `demo_settings`): the synthetic corpus of
examples/financial_reports, its tool server (search / list / cat) and its grader server under
uvicorn on 127.0.0.1, the browsing traces, workers.methods.supervised's supervised trainer, the rollout engine and
workers.methods.reinforcement.trainer.Trainer with in-memory hooks. No Celery, no API: what is measured is the
learning, not the plumbing.

    .venv/bin/python -m benchmarks.demo_learning.run train [--seeds 0 1 2]
    .venv/bin/python -m benchmarks.demo_learning.run signal [--samples 30 --k 4]

`train`, per seed: browsing traces for the training questions; the base model, the starting agent
(supervised on the traces) and the starting agent after reinforcement fine-tuning, each evaluated
on the held-out companies (questions about companies never trained on) with the same rollout
seeds; prints mean ± spread (half the max-min range) over seeds and per seed, and writes
benchmarks/results/demo_learning.json.
`signal`: k rollouts of the base model per training question; the shares of questions always
wrong / always right / mixed (only mixed ones carry a GRPO gradient).
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
    from dataclasses import asdict

    from examples.financial_reports.demo_config import CORRECT_ANSWER, DEMO, dtype
    from workers.methods.reinforcement.hyperparameters import group_size_for

    x, sft = DEMO.x_open_model, DEMO.sft_x_open_model
    return {
        "model": DEMO.model,
        "dtype": dtype(DEMO),
        "task": {"corpus_seed": DEMO.seed, "companies": DEMO.companies, "years": list(DEMO.years),
                 "held_out_companies": DEMO.held_out_companies, "rft_companies": DEMO.rft_companies},
        "system_prompt": DEMO.system_prompt,
        "grader": CORRECT_ANSWER,  # what the evaluations count as correct
        "charges": asdict(DEMO.charges),  # the reinforcement job's grader server
        "traces": {"per_question": DEMO.traces_per_question, "cat_limit": DEMO.cat_limit},
        "supervised": {**DEMO.sft_hyperparameters, "learning_rate": sft["learning_rate"], "lora_rank": sft["lora_rank"],
                       "lora_alpha": sft["lora_alpha"], "max_seq_tokens": sft["max_seq_tokens"]},
        "engine": {"max_episode_steps": DEMO.tool_budget, "max_tokens_per_turn": x["max_tokens_per_turn"],
                   "max_tokens_per_rollout": x["max_tokens_per_rollout"], "temperature": x["temperature"],
                   "top_p": x.get("top_p", 1.0)},
        "training": {"batch_size": DEMO.hyperparameters["batch_size"],
                     "group_size": group_size_for(DEMO.hyperparameters["compute_multiplier"]),
                     "steps": DEMO.steps, "learning_rate": x["learning_rate"], "lora_rank": sft["lora_rank"],
                     "lora_alpha": sft["lora_alpha"], "loss": x["loss"], "kl_coef": x["kl_coef"],
                     "clip_epsilon": x.get("clip_epsilon", 0.2)},
        "eval": {"rollouts_per_question": DEMO.eval_rollouts_per_row},
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
    from workers.engine.rollout import EngineConfig

    return EngineConfig(**settings["engine"])


def grader(settings: dict[str, Any]) -> Any:
    from pydantic import TypeAdapter

    from agent_rft.graders.schemas import Grader

    return TypeAdapter(Grader).validate_python(settings["grader"])


async def rollouts(loaded: Any, client: Any, settings: dict[str, Any], rows: list[dict], k: int,
                   seed: int) -> list[dict[str, Any]]:
    """k graded rollouts per row; the seeds depend on (seed, row, k) only, so before and after
    training see the same draws."""
    from agent_rft.graders.core import GraderContext
    from examples.financial_reports.server import TOOL_SCHEMAS
    from workers.engine.prompting import ChatFormatter
    from workers.engine.rollout import RolloutEngine, RolloutSpec
    from workers.engine.toolcalls import ToolSchema
    from workers.training.data import rollout_seed
    from workers.engine.grading import grade_rollouts

    schemas = [ToolSchema.from_openai(t) for t in TOOL_SCHEMAS]
    specs = [RolloutSpec(i, row["messages"], schemas, {key: v for key, v in row.items() if key != "messages"},
                         seed=rollout_seed(seed, "bench", i, j)) for i, row in enumerate(rows) for j in range(k)]
    engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client,
                           engine_config(settings))
    records = await engine.run(specs)
    graded = await grade_rollouts(grader(settings), GraderContext(), records, [s.item for s in specs])
    return [{"row": s.sample_index, "reward": g.reward or 0.0, **sub_rewards(g), "record": g.record,
             "tool_calls": len(g.record.tool_calls), "tools": [call.name for call in g.record.tool_calls],
             "finish": g.record.finish_reason, "answer": g.record.final_answer, "messages": g.record.messages}
            for s, g in zip(specs, graded)]


def sub_rewards(graded: Any) -> dict[str, float]:
    """A multi grader's sub-rewards by name; a single grader's reward as `correct`."""
    subs = (graded.grade.result.sub_rewards or {}) if graded.grade else {}
    if not subs:
        return {"correct": graded.reward or 0.0}
    return {key: float(value) for key, value in subs.items()}


def metrics(results: list[dict[str, Any]]) -> dict[str, float]:
    """What the demo's table shows, per rollout: correct answers, tool calls (by tool), tokens
    written and read, seconds, answered within the budget (workers.engine.summary over the records)."""
    from workers.engine.summary import summarize

    summary = summarize([r["record"] for r in results])
    by_tool = summary["tool_calls_per_rollout_by_tool"]
    completion, tool_output = summary["completion_tokens_per_rollout"], summary["tool_output_tokens_per_rollout"]
    return {"correct": mean(r["correct"] for r in results),
            "tool_calls_per_rollout": summary["tool_calls_per_rollout"],
            **{f"{name}_calls_per_rollout": by_tool.get(name, 0.0) for name in ("search", "list", "cat")},
            "completion_tokens_per_rollout": completion, "tool_output_tokens_per_rollout": tool_output,
            "tokens_per_rollout": completion + tool_output,
            "seconds_per_rollout": summary["wall_time_s_mean"],
            "within_budget": 1 - summary["budget_exhausted_rate"],
            "answered_rate": summary["finish_reasons"].get("answered", 0.0),
            "parse_error_rate": summary["parse_error_rate"]}


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
    from workers.methods.reinforcement.hyperparameters import TrainingConfig

    t = settings["training"]
    n_epochs = math.ceil(t["steps"] * t["batch_size"] / n_train)  # at least `steps`; the hooks stop there
    return TrainingConfig(
        batch_size=t["batch_size"], n_epochs=n_epochs, group_size=t["group_size"], learning_rate=t["learning_rate"],
        eval_interval=10_000, eval_samples=1, loss=t["loss"], kl_coef=t["kl_coef"], clip_epsilon=t["clip_epsilon"],
        training_mode="lora", lora_rank=t["lora_rank"], lora_alpha=t["lora_alpha"], engine=engine_config(settings),
        seed=seed)


class SupervisedHooks(QuietHooks):
    """The supervised trainer's reporting channel: a line per step."""

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
        self.metrics.append(metrics)
        print(f"  supervised step {step}/{metrics['total_steps']}: loss {metrics['train_loss']:.3f} token accuracy "
              f"{metrics['train_mean_token_accuracy']:.3f} {metrics['timing']['step_s']:.1f}s", flush=True)

    async def control(self) -> str:
        return "continue"


async def starting_agent(settings: dict[str, Any], loaded: Any, traces: list[dict], seed: int, work_dir: Path) -> dict:
    """Supervised fine-tuning on the browsing traces, in place on `loaded` (a LoRA adapter)."""
    from workers.methods.supervised.hyperparameters import SupervisedConfig
    from workers.methods.supervised.trainer import SupervisedTrainer

    s = settings["supervised"]
    config = SupervisedConfig(batch_size=s["batch_size"], n_epochs=s["n_epochs"], learning_rate=s["learning_rate"],
                              eval_interval=10_000, lora_rank=s["lora_rank"], lora_alpha=s["lora_alpha"],
                              max_seq_tokens=s["max_seq_tokens"], seed=seed)
    hooks = SupervisedHooks(0)
    started = time.perf_counter()
    outcome = await SupervisedTrainer(loaded=loaded, config=config, train_rows=traces, valid_rows=[],
                                      work_dir=work_dir, hooks=hooks).run()
    if outcome.status != "succeeded":
        raise RuntimeError(f"supervised training failed: {outcome.error}")
    return {"seconds": time.perf_counter() - started, "loss_curve": [m["train_loss"] for m in hooks.metrics]}


async def reinforce(settings: dict[str, Any], loaded: Any, client: Any, grader_url: str, port: int,
                    train_rows: list[dict], held_out: list[dict], seed: int, work_dir: Path) -> dict:
    """Reinforcement fine-tuning of the starting agent (its adapter, continued) with the demo's
    endpoint grader: the right answer, charged for tool calls and tokens."""
    from pydantic import TypeAdapter

    from agent_rft.graders.core import GraderContext
    from agent_rft.graders.schemas import Grader
    from examples.financial_reports.demo_config import grader_spec
    from workers.methods.reinforcement.trainer import Trainer

    config = training_config(settings, len(train_rows), seed)
    config = replace(config, eval_interval=10_000 * config.n_epochs)
    hooks = QuietHooks(settings["training"]["steps"])
    trainer = Trainer(loaded=loaded, config=config, train_rows=train_rows, valid_rows=held_out[:1],
                      grader=TypeAdapter(Grader).validate_python(grader_spec(grader_url)),
                      grader_ctx=GraderContext(outbound_allowlist=["127.0.0.1"]), tool_client=client,
                      job_tools=tool_endpoints(port), work_dir=work_dir, hooks=hooks)
    started = time.perf_counter()
    outcome = await trainer.run()
    if len(hooks.metrics) < settings["training"]["steps"]:
        raise RuntimeError(f"training failed: {outcome.error}")
    steps = [m["timing"]["step"]["full_iteration"] for m in hooks.metrics]
    return {"seconds": time.perf_counter() - started, "steps": len(steps), "step_seconds_mean": mean(steps),
            "reward_curve": [m["scores"]["train_reward_mean"] for m in hooks.metrics],
            "tool_calls_curve": [m["tools"].get("tool_calls_per_rollout", 0) for m in hooks.metrics],
            "mixed_group_share_curve": [1 - m["train"]["frac_reward_zero_std"] for m in hooks.metrics]}


async def train_one_seed(settings: dict[str, Any], port: int, grader_url: str, train_rows: list[dict],
                         held_out: list[dict], seed: int, work_dir: Path) -> dict[str, Any]:
    """The demo's story for one seed: the base model, the starting agent (supervised on browsing
    traces of some training companies), then reinforcement fine-tuning of it (on the questions
    about the other training companies), each evaluated on the held-out companies with the same
    rollout seeds."""
    from examples.financial_reports.demo_task import split_by_company
    from examples.financial_reports.traces import browsing_traces, tool_calls_of
    from workers.models.loading import load_model
    from workers.engine.tools_client import ToolClient

    loaded = load_model(settings["model"], dtype=settings["dtype"])
    k = settings["eval"]["rollouts_per_question"]
    evaluations, samples = {}, {}
    async with ToolClient(tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        trace_rows, rft_rows = split_by_company(train_rows, settings["task"]["rft_companies"])
        traces = await browsing_traces(trace_rows, client, seed=seed, per_row=settings["traces"]["per_question"],
                                       cat_limit=settings["traces"]["cat_limit"])

        async def evaluate(stage: str) -> None:
            results = await rollouts(loaded, client, settings, held_out, k, seed=1000 + seed)
            evaluations[stage], samples[stage] = metrics(results), [transcript(r) for r in results[:4]]
            print(f"seed {seed}, {stage}: {evaluations[stage]}", flush=True)

        await evaluate("base")
        supervised = await starting_agent(settings, loaded, traces, seed, work_dir / "supervised")
        await evaluate("starting_agent")
        reinforcement = await reinforce(settings, loaded, client, grader_url, port, rft_rows, held_out, seed,
                                        work_dir / "reinforcement")
        await evaluate("after_rft")
    calls = [tool_calls_of(trace) for trace in traces]
    return {"seed": seed, **evaluations, "traces": len(traces), "trace_calls_mean": mean(calls),
            "supervised": supervised, "reinforcement": reinforcement, "samples": samples}


def transcript(result: dict[str, Any]) -> dict[str, Any]:
    """What one rollout did, for reading: the model's turns and the start of each tool's answer."""
    turns = [f"{m['role']}: {str(m.get('content'))[:160]}" for m in result["messages"]
             if m["role"] in ("assistant", "tool")]
    return {"finish": result["finish"], "correct": result["correct"], "tools": result["tools"], "turns": turns}


def spread(values: list[float]) -> tuple[float, float]:
    return mean(values), (max(values) - min(values)) / 2


ROWS = ("correct", "tool_calls_per_rollout", "search_calls_per_rollout", "list_calls_per_rollout",
        "cat_calls_per_rollout", "completion_tokens_per_rollout", "tool_output_tokens_per_rollout",
        "tokens_per_rollout", "seconds_per_rollout", "within_budget", "answered_rate")
STAGES = ("base", "starting_agent", "after_rft")


def table(runs: list[dict[str, Any]]) -> str:
    """Mean ± spread over seeds per stage, and the change from the starting agent to after RFT."""
    lines = ["| held-out, per rollout | base | starting agent (SFT) | after RFT | change |", "|---|---|---|---|---|"]
    for key in ROWS:
        cells = [spread([r[stage][key] for r in runs]) for stage in STAGES]
        start, end = cells[1][0], cells[2][0]
        change = (f"{100 * (end - start):+.0f} pts" if key in ("correct", "within_budget", "answered_rate")
                  else f"{(end - start) / start:+.0%}" if start else "-")
        lines.append(f"| {key} | " + " | ".join(f"{m:.3f} ± {h:.3f}" for m, h in cells) + f" | {change} |")
    for stage in ("supervised", "reinforcement"):
        t = spread([r[stage]["seconds"] for r in runs])
        lines.append(f"| {stage} training time (s) | | {t[0]:.0f} ± {t[1]:.0f} | | |")
    return "\n".join(lines)


# The demo's targets, after RFT against the starting agent: relative changes, and points of correct answers.
TARGETS = (("tool calls per rollout", "tool_calls_per_rollout", -0.50), ("tokens per rollout", "tokens_per_rollout", -0.35),
           ("seconds per rollout", "seconds_per_rollout", -0.20))
CORRECT_TARGET_POINTS = 10


def targets_table(runs: list[dict[str, Any]]) -> str:
    """Each target: each seed's change from the starting agent to after RFT, the change of the
    seeds' means, and whether every seed met it and whether the mean did."""
    seeds = " | ".join(f"seed {r['seed']}" for r in runs)
    lines = [f"| after RFT vs the starting agent | target | {seeds} | mean of the seeds | met by every seed | met by the mean |",
             "|---|---|" + "---|" * len(runs) + "---|---|---|"]

    def mean(stage: str, key: str) -> float:
        return sum(r[stage][key] for r in runs) / len(runs)

    def yes(ok: bool) -> str:
        return "yes" if ok else "no"

    for name, key, target in TARGETS:
        changes = [(r["after_rft"][key] - r["starting_agent"][key]) / r["starting_agent"][key] for r in runs]
        overall = (mean("after_rft", key) - mean("starting_agent", key)) / mean("starting_agent", key)
        cells = " | ".join(f"{c:+.0%}" for c in changes)
        lines.append(f"| {name} | {target:+.0%} or less | {cells} | {overall:+.0%} | "
                     f"{yes(all(c <= target for c in changes))} | {yes(overall <= target)} |")
    points = [100 * (r["after_rft"]["correct"] - r["starting_agent"]["correct"]) for r in runs]
    overall = sum(points) / len(points)
    cells = " | ".join(f"{p:+.0f} pts" for p in points)
    lines.append(f"| correct answers | +{CORRECT_TARGET_POINTS} pts or more | {cells} | {overall:+.0f} pts | "
                 f"{yes(all(p >= CORRECT_TARGET_POINTS for p in points))} | {yes(overall >= CORRECT_TARGET_POINTS)} |")
    return "\n".join(lines)


def per_seed_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| seed | correct | tool calls | tokens (completion + tool output) | seconds | within budget |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        def cell(key: str, spec: str) -> str:
            return " → ".join(format(r[stage][key], spec) for stage in STAGES[1:])
        lines.append(f"| {r['seed']} | {cell('correct', '.0%')} | {cell('tool_calls_per_rollout', '.2f')} | "
                     f"{cell('tokens_per_rollout', '.0f')} | {cell('seconds_per_rollout', '.1f')} | "
                     f"{cell('within_budget', '.0%')} |")
    return "\n".join(lines)


# --- commands -------------------------------------------------------------------------------------


def serve_tools(stack: ExitStack, corpus: Path, cache: Path, *, suggest_cat: bool = False) -> int:
    from examples.financial_reports.server import create_app
    from tests.conftest import serve_app

    return stack.enter_context(serve_app(create_app(corpus, index_cache_dir=cache, suggest_cat=suggest_cat)))


def serve_grader(stack: ExitStack, tools_port: int, settings: dict[str, Any]) -> str:
    """The demo's grader server (right answer x efficiency) on 127.0.0.1; its base URL."""
    from examples.financial_reports.grader_server import Charges, create_grader_app
    from tests.conftest import serve_app

    app = create_grader_app(f"http://127.0.0.1:{tools_port}", charges=Charges(**settings["charges"]))
    return f"http://127.0.0.1:{stack.enter_context(serve_app(app))}"


async def measure_signal(settings: dict[str, Any], port: int, rows: list[dict], k: int) -> dict[str, Any]:
    from workers.models.loading import load_model
    from workers.engine.tools_client import ToolClient

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
            grader_url = serve_grader(stack, port, settings)
            runs = []
            for seed in args.seeds:
                runs.append(asyncio.run(train_one_seed(settings, port, grader_url, train_rows, held_out, seed,
                                                       Path(tmp) / f"run-{seed}")))
                save("train", merged_runs(settings, runs))  # each seed as soon as it is done
            out = merged_runs(settings, runs)
            print(out["table"])
            print(out["per_seed"])
            print(out["targets"])
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
    return {"runs": merged, "seeds": sorted(kept), "settings": settings, "table": table(merged),
            "per_seed": per_seed_table(merged), "targets": targets_table(merged)}


def load() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def save(command: str, out: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**load(), command: out}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
