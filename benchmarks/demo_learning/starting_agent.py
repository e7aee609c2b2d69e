"""The starting agent: SmolLM2-135M-Instruct warm-started by supervised fine-tuning on browsing
traces (examples/financial_reports/traces.py), against the base model, on held-out companies with a
budget of 10 tool calls. Is the starting agent the over-browsing one that RFT then makes efficient?

    .venv/bin/python -m benchmarks.demo_learning.starting_agent --seeds 0 [--per-row 2] [--epochs 1]

Writes the `starting_agent` entry of benchmarks/results/demo_learning.json.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.demo_learning.run import build_task, demo_settings, metrics, rollouts, save, serve_tools, tool_endpoints

ROWS = ("accuracy", "tool_calls_per_rollout", "search_calls_per_rollout", "list_calls_per_rollout",
        "cat_calls_per_rollout", "tokens_per_rollout", "tool_output_tokens_per_rollout", "seconds_per_rollout",
        "within_budget")


def browsing_settings(max_tokens_per_turn: int, max_tokens_per_rollout: int) -> dict[str, Any]:
    from examples.financial_reports.demo_config import grader_spec
    from examples.financial_reports.traces import BROWSING_PROMPT

    settings = demo_settings()
    settings["system_prompt"] = BROWSING_PROMPT
    settings["grader"] = {**grader_spec("numeric_match"), "name": "correct"}
    settings["engine"].update(max_episode_steps=10, max_tokens_per_turn=max_tokens_per_turn,
                              max_tokens_per_rollout=max_tokens_per_rollout)
    return settings


class SupervisedHooks:
    """The supervised trainer's reporting channel, in memory; a line per step."""

    def __init__(self) -> None:
        self.metrics: list[dict] = []

    async def on_step(self, step: int, metrics: dict, train_records: list[dict]) -> None:
        self.metrics.append(metrics)
        print(f"  sft step {step}/{metrics['total_steps']}: loss {metrics['train_loss']:.3f} "
              f"token accuracy {metrics['train_mean_token_accuracy']:.3f} {metrics['timing']['step_s']:.1f}s", flush=True)

    async def on_eval(self, step: int, valid_reward_mean: float, valid_records: list[dict]) -> None: ...

    async def on_checkpoint(self, step: int, path: Path, metrics: dict) -> list[str]:
        return []

    async def on_state_saved(self, completed_steps: int, state_path: Path, trained_tokens: int) -> None: ...

    async def control(self) -> str:
        return "continue"

    async def on_event(self, level: str, message: str, data: dict | None) -> None:
        print(f"  [{level}] {message}", flush=True)


def with_budget(results: list[dict[str, Any]]) -> dict[str, float]:
    return {**metrics(results), "within_budget": mean(r["finish"] != "tool_budget" for r in results)}


async def one_seed(settings: dict[str, Any], port: int, train_rows: list[dict], held_out: list[dict], seed: int,
                   work_dir: Path, per_row: int, epochs: int, learning_rate: float,
                   cat_limit: int) -> dict[str, Any]:
    from examples.financial_reports.traces import browsing_traces
    from workers.rl.models import load_model
    from workers.rl.tools_client import ToolClient
    from workers.sft.hyperparameters import SupervisedConfig
    from workers.sft.trainer import SupervisedTrainer

    k = settings["eval"]["rollouts_per_question"]
    async with ToolClient(tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        traces = await browsing_traces(train_rows, client, seed=seed, per_row=per_row, cat_limit=cat_limit)
        loaded = load_model(settings["model"], dtype=settings["dtype"])
        before = await rollouts(loaded, client, settings, held_out, k, seed=1000 + seed)
        print(f"seed {seed}: base {with_budget(before)}", flush=True)
        config = SupervisedConfig(batch_size=8, n_epochs=epochs, learning_rate=learning_rate, eval_interval=10_000,
                                  lora_rank=16, lora_alpha=32, seed=seed)
        hooks = SupervisedHooks()
        started = time.perf_counter()
        outcome = await SupervisedTrainer(loaded=loaded, config=config, train_rows=traces, valid_rows=[],
                                          work_dir=work_dir, hooks=hooks).run()
        sft_seconds = time.perf_counter() - started
        if outcome.status != "succeeded":
            raise RuntimeError(f"supervised training failed: {outcome.error}")
        after = await rollouts(loaded, client, settings, held_out, k, seed=1000 + seed)
        print(f"seed {seed}: starting agent {with_budget(after)}", flush=True)
    calls = [len([m for m in t["messages"] if m.get("tool_calls")]) for t in traces]
    return {"seed": seed, "traces": len(traces), "trace_calls_mean": mean(calls), "sft_seconds": sft_seconds,
            "sft_loss_curve": [m["train_loss"] for m in hooks.metrics], "base": with_budget(before),
            "starting_agent": with_budget(after),
            "finish_reasons": {"base": dict(Counter(r["finish"] for r in before)),
                               "starting_agent": dict(Counter(r["finish"] for r in after))},
            "call_counts_differ": differing_call_counts(after),
            "samples": [transcript(r) for r in after[:8]]}


def transcript(result: dict[str, Any]) -> dict[str, Any]:
    """What one rollout did, for reading: the model's turns and the start of each tool's answer."""
    turns = [f"{m['role']}: {str(m.get('content'))[:160]}" for m in result["messages"]
             if m["role"] in ("assistant", "tool")]
    return {"finish": result["finish"], "tools": result["tools"], "turns": turns}


def differing_call_counts(results: list[dict[str, Any]]) -> float:
    """Share of questions whose rollouts made different numbers of calls: the spread RL learns from."""
    by_row: dict[int, set[int]] = {}
    for r in results:
        by_row.setdefault(r["row"], set()).add(r["tool_calls"])
    return mean(len(counts) > 1 for counts in by_row.values())


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| held-out, per rollout | base | starting agent (SFT) |", "|---|---|---|"]
    for key in ROWS:
        base, sft = mean(r["base"][key] for r in runs), mean(r["starting_agent"][key] for r in runs)
        lines.append(f"| {key} | {base:.3f} | {sft:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--per-row", type=int, default=2, help="traces per training question")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--cat-limit", type=int, default=1200, help="characters a trace's cat reads")
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    parser.add_argument("--max-tokens-per-rollout", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = browsing_settings(args.max_tokens_per_turn, args.max_tokens_per_rollout)
    runs = []
    with tempfile.TemporaryDirectory(prefix="starting-agent-") as tmp, ExitStack() as stack:
        corpus, train_rows, held_out = build_task(settings, Path(tmp) / "data")
        port = serve_tools(stack, corpus, Path(tmp) / "index")
        for seed in args.seeds:
            runs.append(asyncio.run(one_seed(settings, port, train_rows, held_out, seed, Path(tmp) / f"run-{seed}",
                                             args.per_row, args.epochs, args.learning_rate, args.cat_limit)))
    out = {"runs": runs, "settings": {**settings, "per_row": args.per_row, "epochs": args.epochs,
                                      "learning_rate": args.learning_rate, "cat_limit": args.cat_limit},
           "table": table(runs)}
    print(out["table"])
    save("starting_agent", out)


if __name__ == "__main__":
    main()
