"""`method.type = "reinforcement"` in the control plane: the block checked and stored (tools and
graders checked, their header values sealed), a row of its files (a prompt whose tools the job
declares), and how its checkpoints rank (validation reward, higher is better)."""

from __future__ import annotations

from typing import Any

from app.core.config import Settings
from app.dashboard.charts import Chart, Series
from app.core.crypto import secret_box
from app.core.errors import APIError, bad_request
from agent_rft.urls import BlockedURL, guard_url
from app.graders.service import check_grader_urls, check_python_isolation
from app.jobs import tool_headers
from app.jobs.schemas import Method
from app.jobs.validation import RowRule, check_row, parameters_schema_problem

TYPE = "reinforcement"
# A checkpoint's score among its flattened metrics, and its direction: the trainer's step metrics
# nest it under "scores".
SCORE_KEYS = (("scores.valid_reward_mean", 1.0),)


def row_rule(declared_tools: set[str]) -> RowRule:
    return lambda row: check_row(row, declared_tools)


def check_tools(tools: list[Any], settings: Settings, *, param: str) -> None:
    """Tool endpoints (a job's, an eval run's): names once each, parameters a JSON schema, every
    server_url allowed by the outbound guard; else 400 naming the field under `param`."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(f"Tool '{tool.name}' is declared twice.", param=f"{param}[{i}].name",
                              code="duplicate_tool")
        seen.add(tool.name)
        if tool.parameters is not None:
            problem = parameters_schema_problem(tool.parameters)
            if problem:
                raise bad_request(f"Tool '{tool.name}' parameters {problem}.", param=f"{param}[{i}].parameters",
                                  code="invalid_tool_schema")
        try:
            guard_url(tool.server_url, settings.outbound_allowlist, strict_resolution=False)
        except BlockedURL as exc:
            raise bad_request(f"Tool '{tool.name}' server_url is not allowed: {exc}.",
                              param=f"{param}[{i}].server_url", code="url_not_allowed") from exc


def check_grader(grader: Any, settings: Settings, *, param: str) -> None:
    """A grader's outbound URLs allowed, and its python code runnable under the required isolation."""
    check_grader_urls(grader, settings.outbound_allowlist, param=param)
    check_python_isolation(grader, required=settings.python_grader_required_isolation,
                           cap=settings.python_grader_isolation_cap, param=param)


def stored_block(method: Method, settings: Settings) -> dict[str, Any]:
    """The stored reinforcement block: tools and graders checked, their header values sealed."""
    if method.reinforcement is None:
        raise APIError(400, "method.reinforcement is required when method.type is 'reinforcement'.",
                       code="missing_required_parameter", param="method.reinforcement")
    check_tools(method.reinforcement.tools, settings, param="method.reinforcement.tools")
    check_grader(method.reinforcement.grader, settings, param="method.reinforcement.grader")
    stored = {"type": "reinforcement", "reinforcement": method.reinforcement.model_dump(mode="json")}
    return tool_headers.seal_headers(stored, secret_box(settings))

# The job page's charts: rewards, tools, graders, the loss and where a step's time goes.
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
    Chart("staleness", "Sampling policy lag", "versions", (
        Series("mean", key="train.staleness_mean"),
        Series("max", key="train.staleness_max"),
    ), help="How many optimizer steps the policies that sampled a step's turns lag the one its update starts "
            "from: 0 for synchronous steps, at most 1 when the next step is sampled during the update "
            "(x_open_model.max_staleness)."),
    Chart("prompts-drawn", "Prompts drawn per step", "prompts", (
        Series("drawn", key="train.prompts_drawn"),
    ), help="batch_size, or more where refill_zero_spread drew prompts again for groups without a reward spread."),
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
)
