"""`agent-rft eval`: rollouts of a model (before or after training) with the training engine,
each graded the way training grades (workers/engine/grading.py): accuracy and tool use. Tool
failures are graded too, as what the model answered; training excludes them instead."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.engine.grading import GradedRollout, grade_rollouts, sub_reward_means
from workers.engine.rollout import EngineConfig, RolloutRecord
from workers.commands.rollout_command import RolloutInputError, read_specs, read_tools, run_rollouts
from workers.engine.summary import format_table, summarize

PASS_THRESHOLD = 0.5  # a reward at or above this counts as passed when the grader has no threshold


def read_grader(path: Path) -> Any:
    from pydantic import TypeAdapter, ValidationError

    from agent_rft.graders.schemas import Grader

    try:
        return TypeAdapter(Grader).validate_json(path.read_bytes())
    except OSError as exc:
        raise RolloutInputError(f"{path}: cannot read the grader: {exc}") from exc
    except ValidationError as exc:
        raise RolloutInputError(f"{path}: invalid grader: {exc}") from exc


def eval_command(*, model: str, data: Path, tools_path: Path, grader_path: Path, n: int, limit: int | None,
                 config: EngineConfig, settings: Any, json_out: Path | None, echo: Callable[[str], None],
                 dtype: str | None = None) -> dict[str, Any]:
    """Raises RolloutInputError (bad inputs) or ModelError (a model that cannot be loaded)."""
    from agent_rft.graders.core import GraderContext
    from workers.models.loading import load_model

    grader = read_grader(grader_path)
    tools = read_tools(tools_path)
    specs = read_specs(data, tools, n=n, limit=limit, seed=0)
    if not specs:
        raise RolloutInputError(f"{data}: no rows")
    records = asyncio.run(run_rollouts(model, specs, tools, config, list(settings.outbound_allowlist), dtype))
    grader_ctx = GraderContext.from_settings(settings, load_judge_model=load_model)
    graded = asyncio.run(grade_rollouts(grader, grader_ctx, records, [s.item for s in specs], grade_tool_failures=True))
    report = eval_report(model, records, graded)
    echo(format_eval(report))
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
        echo(f"\nwrote {json_out}")
    return report


def eval_report(model: str, records: list[RolloutRecord], graded: list[GradedRollout]) -> dict[str, Any]:
    grades = [g.grade for g in graded]
    rewards = [g.reward for g in grades]
    passed = [g.passed if g.passed is not None else g.reward >= PASS_THRESHOLD for g in grades]
    accuracy = {"mean_reward": sum(rewards) / len(rewards), "pass_rate": sum(passed) / len(passed),
                "grader_errors": sum(1 for g in grades if g.failed), "sub_rewards": sub_reward_means(graded)}
    rollouts = [{**r.summary(), "reward": g.reward, "passed": p, "grader_errors": g.errors,
                 "sub_rewards": {k: float(v) for k, v in (g.result.sub_rewards or {}).items()
                                 if isinstance(v, (int, float))}}
                for r, g, p in zip(records, grades, passed)]
    return {"model": model, "accuracy": accuracy, "summary": summarize(records), "rollouts": rollouts}


def format_eval(report: dict[str, Any]) -> str:
    accuracy = report["accuracy"]
    lines = [f"{'model':36} {report['model']}",
             f"{'mean reward':36} {accuracy['mean_reward']:.3f}",
             f"{'passed (reward >= 0.5 or passed)':36} {accuracy['pass_rate']:.0%}",
             f"{'grader errors':36} {accuracy['grader_errors']}"]
    lines += [f"{'  mean ' + name:36} {value:.3f}" for name, value in accuracy.get("sub_rewards", {}).items()]
    return "\n".join(lines) + "\n" + format_table(report["summary"])
