"""Aggregates over rollout records: what the `rollout` command prints, and the raw material of
a training step's `tools` metrics block and of the variance diagnostic."""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import mean
from typing import Any

from workers.engine.rollout import FINISH_REASONS, RolloutRecord


def summarize(records: list[RolloutRecord]) -> dict[str, Any]:
    if not records:
        return {"rollouts": 0}
    n = len(records)
    calls_by_tool: Counter[str] = Counter()
    latency: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    throttled: Counter[str] = Counter()
    throttle_wait: Counter[str] = Counter()
    concurrency: dict[str, list[int]] = defaultdict(list)
    for record in records:
        for call in record.tool_calls:
            calls_by_tool[call.name] += 1
            latency[call.name].append(call.latency_s)
            if call.status != "ok":
                errors[call.name] += 1
            if call.cached:
                hits[call.name] += 1
            throttled[call.name] += call.throttled
            throttle_wait[call.name] += call.throttle_wait_s
            if call.concurrency is not None:
                concurrency[call.name].append(call.concurrency)
    finish = Counter(r.finish_reason for r in records)
    return {
        "rollouts": n,
        "tool_calls_per_rollout": sum(calls_by_tool.values()) / n,
        "tool_calls_per_rollout_by_tool": {name: count / n for name, count in sorted(calls_by_tool.items())},
        "tool_latency_s_mean_by_tool": {name: mean(values) for name, values in sorted(latency.items())},
        "tool_error_rate_by_tool": {name: errors[name] / calls_by_tool[name] for name in sorted(calls_by_tool)},
        # Calls answered from the tool-result cache: each is one request the endpoint did not get.
        "tool_cache_hits_by_tool": {name: hits[name] for name in sorted(calls_by_tool)},
        "tool_cache_hit_rate_by_tool": {name: hits[name] / calls_by_tool[name] for name in sorted(calls_by_tool)},
        "tool_calls_saved": sum(hits.values()),
        # Backpressure: answers that asked to wait (429/503 with Retry-After), the seconds waited for
        # them, and the tool's adaptive concurrency limit (mean over the calls' ends).
        "tool_throttled_by_tool": {name: throttled[name] for name in sorted(calls_by_tool)},
        "tool_throttle_wait_s_by_tool": {name: throttle_wait[name] for name in sorted(calls_by_tool)},
        "tool_concurrency_by_tool": {name: mean(values) for name, values in sorted(concurrency.items())},
        "completion_tokens_per_rollout": mean(r.completion_tokens for r in records),
        "tool_output_tokens_per_rollout": mean(r.tool_output_tokens for r in records),
        "wall_time_s_mean": mean(r.wall_time_s for r in records),
        "wall_time_s_max": max(r.wall_time_s for r in records),
        "parse_errors_per_rollout": mean(r.parse_errors for r in records),
        "finish_reasons": {reason: finish[reason] / n for reason in FINISH_REASONS if finish[reason]},
        "budget_exhausted_rate": finish["tool_budget"] / n,
        "parse_error_rate": sum(1 for r in records if r.parse_errors) / n,
    }


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table of a summary, for terminals."""
    if not summary.get("rollouts"):
        return "no rollouts"
    lines = [f"{'rollouts':36} {summary['rollouts']}",
             f"{'tool calls per rollout':36} {summary['tool_calls_per_rollout']:.2f}"]
    for name, value in summary["tool_calls_per_rollout_by_tool"].items():
        latency = summary["tool_latency_s_mean_by_tool"][name]
        error_rate = summary["tool_error_rate_by_tool"][name]
        hit_rate = summary.get("tool_cache_hit_rate_by_tool", {}).get(name, 0.0)
        cached = f", {hit_rate:.0%} from cache" if hit_rate else ""
        lines.append(f"  {name:34} {value:.2f} calls, {latency * 1000:.0f} ms mean, {error_rate:.0%} errors{cached}")
    lines += [
        f"{'completion tokens per rollout':36} {summary['completion_tokens_per_rollout']:.1f}",
        f"{'tool-output tokens per rollout':36} {summary['tool_output_tokens_per_rollout']:.1f}",
        f"{'wall time per rollout (mean / max)':36} {summary['wall_time_s_mean']:.2f} s / {summary['wall_time_s_max']:.2f} s",
        f"{'parse errors per rollout':36} {summary['parse_errors_per_rollout']:.2f}",
        f"{'finish reasons':36} " + ", ".join(f"{k} {v:.0%}" for k, v in summary["finish_reasons"].items()),
    ]
    return "\n".join(lines)
