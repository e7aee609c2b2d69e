"""The job page's charts: which per-step metrics (keys of job_metrics, i.e. the flattened keys of
the trainer's metrics event, see workers/rl/step_report.py `step_metrics` and workers/sft/trainer.py
`_step_metrics`) each chart draws. A job's page shows the charts of its method.

A series is either one key or every key under a prefix (one trace per tool, per grader...);
the page's script turns these specs into plotly traces, so adding a chart is adding a spec."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Series:
    name: str
    key: str | None = None  # one metric key
    prefix: str | None = None  # or one trace per key under this prefix, named by the rest of the key
    markers: bool = False  # points only where the metric exists (validation runs at eval steps)
    exclude: tuple[str, ...] = ()  # keys under `prefix` to leave out


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    y_title: str
    series: tuple[Series, ...]
    stacked: bool = False  # stacked areas, with a toggle to shares of the total
    percent: bool = False  # values are rates in [0, 1]
    help: str = ""
    method: str = "reinforcement"  # the method.type whose jobs report these metrics


CHARTS: tuple[Chart, ...] = (
    Chart("reward", "Reward", "mean reward", (
        Series("train", key="scores.train_reward_mean"),
        Series("validation", key="scores.valid_reward_mean", markers=True),
    ), help="Mean grader reward of the step's training rollouts, and of the fixed validation set at eval steps."),
    Chart("grader-rewards", "Reward per grader", "mean sub-reward", (
        Series("train", prefix="scores.train_sub_rewards."),
        Series("validation", prefix="scores.valid_sub_rewards.", markers=True),
    ), help="For multi graders: each sub-grader's mean score."),
    Chart("tool-mix", "Tool calls per rollout, by tool", "calls per rollout", (
        Series("tool", prefix="tools.tool_calls_per_rollout_by_tool."),
    ), stacked=True, help="How the policy splits its calls between tools; switch to shares to see the mix shift."),
    Chart("tool-calls", "Tool calls per rollout", "calls per rollout", (
        Series("all tools", key="tools.tool_calls_per_rollout"),
        Series("parse errors", key="tools.parse_errors_per_rollout"),
    )),
    Chart("tokens", "Tokens per rollout", "tokens", (
        Series("completion", key="tools.completion_tokens_per_rollout"),
        Series("tool output", key="tools.tool_output_tokens_per_rollout"),
    )),
    Chart("rollout-latency", "Rollout latency", "seconds", (
        Series("mean", key="tools.wall_time_s_mean"),
        Series("max", key="tools.wall_time_s_max"),
    )),
    Chart("tool-latency", "Tool latency, by tool", "seconds (mean)", (
        Series("tool", prefix="tools.tool_latency_s_mean_by_tool."),
    )),
    Chart("tool-errors", "Tool error rate, by tool", "share of calls", (
        Series("tool", prefix="tools.tool_error_rate_by_tool."),
    ), percent=True),
    Chart("tool-cache", "Tool-result cache hit rate, by tool", "share of calls", (
        Series("tool", prefix="tools.tool_cache_hit_rate_by_tool."),
    ), percent=True, help="Calls of read-only tools with `cache` answered from the job's cache: each hit is one "
                          "request the endpoint did not get."),
    Chart("tool-throttled", "Throttled tool answers, by tool", "answers per step", (
        Series("tool", prefix="tools.tool_throttled_by_tool."),
    ), help="429/503 answers with Retry-After: waited out as asked, without spending the call's retries."),
    Chart("tool-throttle-wait", "Time waiting on throttled tools, by tool", "seconds per step", (
        Series("tool", prefix="tools.tool_throttle_wait_s_by_tool."),
    )),
    Chart("tool-concurrency", "Tool concurrency, by tool", "requests in flight (limit)", (
        Series("tool", prefix="tools.tool_concurrency_by_tool."),
    ), help="Halves when a tool throttles, creeps back up to its max_concurrency as calls succeed."),
    Chart("grader-backpressure", "Throttled grader answers", "per step", (
        Series("throttled answers", key="graders.throttled"),
        Series("seconds waiting", key="graders.throttle_wait_s"),
    ), help="429/503 answers with Retry-After from endpoint graders and judge models, waited out as asked."),
    Chart("episode-failures", "Budget exhausted and parse errors", "share of rollouts", (
        Series("tool budget exhausted", key="tools.budget_exhausted_rate"),
        Series("parse error", key="tools.parse_error_rate"),
    ), percent=True),
    Chart("zero-std", "Groups with no reward spread (frac_reward_zero_std)", "share of groups", (
        Series("frac_reward_zero_std", key="train.frac_reward_zero_std"),
    ), percent=True, help="Groups whose rollouts all scored the same teach nothing; a rising share means "
                          "the task is too easy or too hard for the policy."),
    Chart("loss", "Loss and KL", "value", (
        Series("loss", key="train.loss"),
        Series("KL", key="train.kl"),
    )),
    Chart("step-time", "Time per step", "seconds", (
        Series("phase", prefix="timing.step.", exclude=("timing.step.full_iteration",)),
    ), stacked=True),
    Chart("step-breakdown", "Where a step's time goes", "seconds", (
        Series("phase", prefix="timing.breakdown."),
    ), stacked=True, help="Sampling split into prefill, decode and the time the model waited (tool calls, "
                          "batching); the update into forward, backward and the optimizer."),
    # Supervised jobs: OpenAI's metrics at the top level, then the trainer's `train` and `timing` blocks.
    Chart("sft-loss", "Loss", "loss per trained token", (
        Series("training", key="train_loss"),
        Series("validation", key="valid_loss", markers=True),
        Series("full validation", key="full_valid_loss", markers=True),
    ), method="supervised", help="Cross-entropy on the tokens the job trains on: the step's batch, a fixed "
                                 "subset of validation rows at eval steps, every validation row at the last step."),
    Chart("sft-accuracy", "Mean token accuracy", "share of trained tokens", (
        Series("training", key="train_mean_token_accuracy"),
        Series("validation", key="valid_mean_token_accuracy", markers=True),
        Series("full validation", key="full_valid_mean_token_accuracy", markers=True),
    ), percent=True, method="supervised", help="Share of trained tokens that are the model's most likely next token."),
    Chart("sft-tokens", "Tokens learned per step", "tokens", (
        Series("learned tokens", key="train.learned_tokens"),
    ), method="supervised"),
    Chart("sft-grad-norm", "Gradient norm", "norm before clipping", (
        Series("grad norm", key="train.grad_norm"),
    ), method="supervised"),
    Chart("sft-step-time", "Time per step", "seconds", (
        Series("step", key="timing.step_s"),
    ), method="supervised"),
    # DPO jobs: OpenAI's losses and the preference scores at the top level, then `train` and `timing`.
    Chart("dpo-loss", "DPO loss", "loss per pair", (
        Series("training", key="train_loss"),
        Series("validation", key="valid_loss", markers=True),
        Series("full validation", key="full_valid_loss", markers=True),
    ), method="dpo", help="-log sigmoid of beta times how much more the policy prefers the preferred answer than "
                          "the reference model does; log 2 (0.69) at the start."),
    Chart("dpo-accuracy", "Preference accuracy", "share of pairs", (
        Series("training", key="train_preference_accuracy"),
        Series("validation", key="valid_preference_accuracy", markers=True),
        Series("full validation", key="full_valid_preference_accuracy", markers=True),
    ), percent=True, method="dpo", help="Share of pairs whose implicit reward, beta × (log π − log π_ref), is "
                                        "higher for the preferred answer."),
    Chart("dpo-margin", "Reward margin", "beta × log-ratio", (
        Series("training", key="train_reward_margin"),
        Series("validation", key="valid_reward_margin", markers=True),
    ), method="dpo", help="Mean implicit reward of the preferred answer minus the non-preferred one's."),
    Chart("dpo-logprob-margin", "Log-prob margin", "log π(preferred) − log π(non-preferred)", (
        Series("training", key="train_logprob_margin"),
        Series("validation", key="valid_logprob_margin", markers=True),
    ), method="dpo", help="The policy's own preference, in summed log-probs of the two answers."),
    Chart("dpo-grad-norm", "Gradient norm", "norm before clipping", (
        Series("grad norm", key="train.grad_norm"),
    ), method="dpo"),
    Chart("dpo-step-time", "Time per step", "seconds", (
        Series("step", key="timing.step_s"),
    ), method="dpo"),
)


def _charts_of(method: str | None) -> list[Chart]:
    return [chart for chart in CHARTS if method is None or chart.method == method]


def chart_specs(method: str) -> list[dict[str, Any]]:
    return [asdict(chart) for chart in _charts_of(method)]


def charted_keys(method: str | None = None) -> tuple[list[str], list[str], list[str]]:
    """The exact keys, key prefixes and excluded keys that the charts of `method` (None: every
    chart) draw, for a SQL filter."""
    charts = _charts_of(method)
    exact = [s.key for c in charts for s in c.series if s.key]
    prefixes = [s.prefix for c in charts for s in c.series if s.prefix]
    excluded = [k for c in charts for s in c.series for k in s.exclude]
    return exact, prefixes, excluded
