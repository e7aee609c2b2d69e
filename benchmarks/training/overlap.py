"""Sampling ahead (`x_open_model.max_staleness` 1) against synchronous steps (0) with slow tools.

The demo's reinforcement job, in-process and for real (the pieces of benchmarks/demo_learning/run.py):
SmolLM2-135M-Instruct in the demo's dtype, the financial-reports task, its tool server (search /
list / cat) and grader server under uvicorn on 127.0.0.1, the starting agent (supervised on the
browsing traces, trained ONCE; the base model never calls a tool) and
workers.methods.reinforcement.trainer.Trainer with in-memory hooks. The job's configuration is the
demo's own reinforcement method (hyperparameters, tool budget, x_open_model) resolved by
resolve_hyperparameters, with `max_staleness` added to x_open_model, and the demo's held-out
questions as validation rows. The tool server answers every tool call (POST /tools) only after
a fixed delay; the grader's reads of the call log are not delayed.

Per tool delay and staleness, `--repeats` runs of `--steps` steps, each from a fresh copy of the
same starting agent; repeat k trains with seed k for both staleness values, so the held-out
reward's spread over repeats is the run-to-run spread (staleness 0 and 1 alternate, so a drift of
the machine hits both). Per run:
- seconds per step: the WALL time between consecutive on_step calls (with staleness 1 the
  step's own timing.step leaves out the sampling done in the background), the last step's eval
  (timing.step.eval) taken out, median over the steps after the first; the first step (first
  control() call -> its on_step) separately;
- the held-out reward: the trainer's eval at the last step (valid_reward_mean over all the
  demo's held-out questions, one rollout each; its time is left out of the step's);
- tool calls per rollout (mean over the steps), and staleness_mean / staleness_max of
  metrics["train"] where the trainer reports them.

    .venv/bin/python -m benchmarks.training.overlap [--delays 0.2 1.0] [--staleness 0 1]
                                                    [--steps 4] [--repeats 3]

`--learning-rate 1e-7 --eval-rows 1` holds the policy still, so that both settings sample the
same work at every step (the demo's rate changes how much the agent browses within a step or two,
and with it the step's cost): the seconds per step of the overlap alone; `--out` names the JSON.

Prints a table (per delay: median s/step of staleness 0 and 1, their ratio, the held-out reward's
median and spread max-min over repeats) and writes benchmarks/results/training_overlap.json.
Target: staleness 1 / staleness 0 seconds per step ≤ 0.6 with 1 s tools (the held-out reward is
reported beside it: does training on one step older samples cost anything?).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from statistics import mean, median
from typing import Any

from benchmarks.demo_learning.run import (QuietHooks, build_task, demo_settings, serve_grader, starting_agent,
                                          tool_endpoints)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "training_overlap.json"
TARGET_RATIO = 0.6  # staleness 1 / staleness 0 seconds per step, with 1 s tools
TARGET_DELAY_S = 1.0


class SlowTools:
    """ASGI middleware: every tool call (POST /tools...) answers only after `delay` seconds."""

    def __init__(self, app: Any, delay: float = 0.0) -> None:
        self.app, self.delay = app, delay

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.delay and scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/tools"):
            await asyncio.sleep(self.delay)
        await self.app(scope, receive, send)


def serve_slow_tools(stack: ExitStack, corpus: Path, cache: Path) -> tuple[int, SlowTools]:
    """The demo's tool server (as demo_learning's serve_tools) behind SlowTools; its port and the middleware."""
    from examples.financial_reports.server import create_app
    from tests.conftest import serve_app

    app = SlowTools(create_app(corpus, index_cache_dir=cache))
    return stack.enter_context(serve_app(app)), app


class WallClockHooks(QuietHooks):
    """QuietHooks (a line per step) that also note when each step is asked for and reported, and the eval."""

    def __init__(self, max_steps: int) -> None:
        super().__init__(max_steps)
        self.first_control: float | None = None
        self.reported_at: list[float] = []
        self.valid_reward: float | None = None

    async def control(self) -> str:
        if self.first_control is None:
            self.first_control = time.perf_counter()
        return await super().control()

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
        self.reported_at.append(time.perf_counter())
        await super().on_step(step, metrics, train_records)

    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict]) -> None:
        self.valid_reward = valid_reward_mean


def rft_config(settings: dict[str, Any], staleness: int, n_train: int, n_valid: int, seed: int,
               learning_rate: float | None = None) -> Any:
    """The demo's reinforcement method (examples/financial_reports/demo.py, reinforcement_method)
    with x_open_model.max_staleness, resolved as the worker resolves a job's."""
    from app.jobs.schemas import TrainingOptions
    from examples.financial_reports.demo_config import DEMO
    from workers.methods.reinforcement.hyperparameters import resolve_hyperparameters

    options = TrainingOptions.model_validate({
        "max_episode_steps": DEMO.tool_budget,
        "hyperparameters": {**DEMO.hyperparameters, "n_epochs": 1, "eval_samples": n_valid},  # every held-out row
        "x_open_model": {**DEMO.x_open_model, "dtype": settings["dtype"], "max_staleness": staleness,
                         **({"learning_rate": learning_rate} if learning_rate else {})}})
    config, _ = resolve_hyperparameters(options, n_train=n_train, n_valid=n_valid, seed=seed)
    if getattr(config, "max_staleness", 0) != staleness:
        raise RuntimeError(f"resolve_hyperparameters does not pass x_open_model.max_staleness={staleness} on")
    return config


async def train_starting_agent(settings: dict[str, Any], port: int, trace_rows: list[dict], seed: int,
                               work_dir: Path) -> Any:
    """The demo's starting agent: supervised on browsing traces of the trace questions (fast tools)."""
    from examples.financial_reports.traces import browsing_traces
    from workers.engine.tools_client import ToolClient
    from workers.models.loading import load_model

    loaded = load_model(settings["model"], dtype=settings["dtype"])
    async with ToolClient(tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        traces = await browsing_traces(trace_rows, client, seed=seed, per_row=settings["traces"]["per_question"],
                                       cat_limit=settings["traces"]["cat_limit"])
    supervised = await starting_agent(settings, loaded, traces, seed, work_dir)
    print(f"starting agent: supervised on {len(traces)} traces in {supervised['seconds']:.0f} s", flush=True)
    return loaded


async def one_run(settings: dict[str, Any], start: Any, port: int, grader_url: str, rows: list[dict],
                  held_out: list[dict], staleness: int, steps: int, seed: int, work_dir: Path,
                  learning_rate: float | None = None) -> dict[str, Any]:
    """One reinforcement run from a fresh copy of the starting agent; what it measured."""
    from pydantic import TypeAdapter

    from agent_rft.graders.core import GraderContext
    from agent_rft.graders.schemas import Grader
    from examples.financial_reports.demo_config import grader_spec
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.trainer import Trainer

    loaded = replace(start, model=copy.deepcopy(start.model))
    hooks = WallClockHooks(steps)
    async with ToolClient(tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        config = rft_config(settings, staleness, len(rows), len(held_out), seed, learning_rate)
        trainer = Trainer(loaded=loaded, config=config,
                          train_rows=rows, valid_rows=held_out,
                          grader=TypeAdapter(Grader).validate_python(grader_spec(grader_url)),
                          grader_ctx=GraderContext(outbound_allowlist=["127.0.0.1"]), tool_client=client,
                          job_tools=tool_endpoints(port), work_dir=work_dir, hooks=hooks)
        outcome = await trainer.run()
    if outcome.status != "succeeded" or len(hooks.metrics) < steps:
        raise RuntimeError(f"training {outcome.status}: {outcome.error}")
    times = [hooks.first_control, *hooks.reported_at]
    wall = [b - a - m["timing"]["step"].get("eval", 0.0) for a, b, m in zip(times, times[1:], hooks.metrics)]
    train = [m["train"] for m in hooks.metrics]
    staleness_means = [t["staleness_mean"] for t in train if t.get("staleness_mean") is not None]
    staleness_maxes = [t["staleness_max"] for t in train if t.get("staleness_max") is not None]
    return {"first_step_s": round(wall[0], 2), "step_s": [round(s, 2) for s in wall[1:]],
            "step_s_median": round(median(wall[1:]), 2) if steps > 1 else None,
            "held_out_reward": hooks.valid_reward,
            "tool_calls_per_rollout": mean(m["tools"].get("tool_calls_per_rollout", 0) for m in hooks.metrics),
            "train_reward": [m["scores"]["train_reward_mean"] for m in hooks.metrics],
            "step_timing": [m["timing"]["step"] for m in hooks.metrics],
            "step_breakdown": [m["timing"]["breakdown"] for m in hooks.metrics],
            "sampled_ahead_timing": [m["timing"].get("ahead") for m in hooks.metrics],
            "completion_tokens": [m["usage"]["completion_tokens"] for m in hooks.metrics],
            "staleness_mean": mean(staleness_means) if staleness_means else None,
            "staleness_max": max(staleness_maxes) if staleness_maxes else None}


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (delay, staleness): medians over repeats; the ratio against staleness 0 at the same delay."""
    out = []
    for delay in sorted({r["delay_s"] for r in runs}):
        for staleness in sorted({r["staleness"] for r in runs if r["delay_s"] == delay}):
            mine = [r for r in runs if (r["delay_s"], r["staleness"]) == (delay, staleness)]
            steps = [r["step_s_median"] for r in mine if r["step_s_median"] is not None]
            rewards = [r["held_out_reward"] for r in mine if r["held_out_reward"] is not None]
            maxes = [r["staleness_max"] for r in mine if r["staleness_max"] is not None]
            out.append({"delay_s": delay, "staleness": staleness, "repeats": len(mine),
                        "step_s_median": median(steps) if steps else None,
                        "first_step_s_median": median(r["first_step_s"] for r in mine),
                        "held_out_reward_median": median(rewards) if rewards else None,
                        "held_out_reward_spread": max(rewards) - min(rewards) if rewards else None,
                        "tool_calls_per_rollout": mean(r["tool_calls_per_rollout"] for r in mine),
                        "staleness_max": max(maxes) if maxes else None})
    for row in out:
        base = next((b["step_s_median"] for b in out if (b["delay_s"], b["staleness"]) == (row["delay_s"], 0)), None)
        row["ratio_vs_staleness_0"] = row["step_s_median"] / base if base and row["step_s_median"] else None
    return out


def table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = ["| tool delay (s) | max_staleness | s/step (median) | ratio vs 0 | first step (s) | held-out reward "
             "median | spread (max-min) | tool calls/rollout | staleness max | repeats |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['delay_s']:g} | {r['staleness']} | {cell(r['step_s_median'], '.2f')} | "
                     f"{cell(r['ratio_vs_staleness_0'], '.2f')} | {r['first_step_s_median']:.2f} | "
                     f"{cell(r['held_out_reward_median'], '.3f')} | {cell(r['held_out_reward_spread'], '.3f')} | "
                     f"{r['tool_calls_per_rollout']:.2f} | {cell(r['staleness_max'], 'g')} | {r['repeats']} |")
    return "\n".join(lines)


def save(settings: dict[str, Any], args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    rows = summary(runs)
    at_target = [r["ratio_vs_staleness_0"] for r in rows
                 if r["delay_s"] == TARGET_DELAY_S and r["staleness"] == 1 and r["ratio_vs_staleness_0"] is not None]
    out = {"settings": {**settings, "delays_s": args.delays, "staleness": args.staleness, "steps": args.steps,
                        "repeats": args.repeats, "threads": args.threads, "learning_rate": args.learning_rate,
                        "eval_rows": args.eval_rows},
           "target": {"ratio_at_1s_tools": TARGET_RATIO, "ratio": at_target[0] if at_target else None,
                      "met": at_target[0] <= TARGET_RATIO if at_target else None},
           "summary": rows, "table": table(rows), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return out["table"]


def main(argv: list[str] | None = None) -> None:
    import torch

    from examples.financial_reports.demo import size_training
    from examples.financial_reports.demo_config import DEMO
    from examples.financial_reports.demo_task import split_by_company

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.2, 1.0], help="seconds per tool call")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="x_open_model.max_staleness values")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the demo's 2 cores)")
    parser.add_argument("--learning-rate", type=float, default=None, help="instead of the demo's (1e-7: hold still)")
    parser.add_argument("--eval-rows", type=int, default=None, help="held-out rows evaluated (default: all 24)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = demo_settings()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="training-overlap-") as tmp, ExitStack() as stack:
        corpus, train_rows, held_out = build_task(settings, Path(tmp) / "data")
        held_out = held_out[: args.eval_rows or DEMO.held_out_rows]
        trace_rows, rft_rows = split_by_company(train_rows, settings["task"]["rft_companies"])
        rows, _ = size_training(rft_rows, args.steps, DEMO.hyperparameters["batch_size"])  # one epoch of `steps`
        port, tools = serve_slow_tools(stack, corpus, Path(tmp) / "index")
        grader_url = serve_grader(stack, port, settings)
        start = asyncio.run(train_starting_agent(settings, port, trace_rows, DEMO.seed, Path(tmp) / "supervised"))
        runs: list[dict[str, Any]] = []
        for delay in args.delays:
            tools.delay = delay
            for repeat in range(args.repeats):
                for staleness in args.staleness:  # alternating, so a drift of the machine hits both
                    print(f"tool delay {delay:g} s, max_staleness {staleness}, repeat {repeat + 1}/{args.repeats}",
                          flush=True)
                    work_dir = Path(tmp) / f"rft-{delay:g}-{staleness}-{repeat}"
                    result = asyncio.run(one_run(settings, start, port, grader_url, rows, held_out, staleness,
                                                 args.steps, repeat, work_dir, args.learning_rate))
                    runs.append({"delay_s": delay, "staleness": staleness, "repeat": repeat, **result})
                    print(f"  -> first step {result['first_step_s']} s, then {result['step_s']} s; held-out reward "
                          f"{result['held_out_reward']}", flush=True)
                    save(settings, args, runs)  # each run as soon as it is done
                    gc.collect()
    print(save(settings, args, runs))
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
