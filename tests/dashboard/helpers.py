"""Shared by the dashboard tests: logging in as a browser would, and a job with steps and
rollouts pushed through the internal worker API (the way a real worker reports them)."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.testclient import TestClient

from tests.test_internal import Worker, supervised_metrics_data

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
TOOLS = ("search", "list", "cat")


def csrf_of(html: str) -> str:
    match = CSRF.search(html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def login(client: TestClient, key: str) -> str:
    """Log in through the form; returns the session's CSRF token."""
    page = client.get("/dashboard/login")
    response = client.post("/dashboard/login", data={"api_key": key, "csrf_token": csrf_of(page.text),
                                                     "next": "/dashboard/jobs"}, follow_redirects=False)
    assert response.status_code == 303, response.text
    return csrf_of(client.get("/dashboard/jobs").text)


def step_metrics(step: int, total: int, *, valid: bool) -> dict[str, Any]:
    share = step / total
    scores: dict[str, Any] = {"train_reward_mean": 0.1 * step, "train_sub_rewards": {"answer": 0.1 * step}}
    if valid:
        scores["valid_reward_mean"] = 0.05 * step
    return {
        "step": step, "total_steps": total, "scores": scores,
        "usage": {"completion_tokens": 100, "tool_output_tokens": 300, "prompt_tokens": 50},
        "errors": {"tool_failures": 0, "grader_failures": 0, "parse_errors": 1},
        "timing": {"step": {"sampling": 1.0, "grading": 0.1, "training": 0.5, "eval": 0.0, "full_iteration": 1.6},
                   "breakdown": {"prefill": 0.3, "decode": 0.5, "tool_wait_and_other": 0.2, "grading": 0.1,
                                 "forward": 0.2, "backward": 0.25, "optimizer_and_other": 0.05, "eval": 0.0}},
        "tools": {"rollouts": 4, "tool_calls_per_rollout": 3.0,
                  "tool_calls_per_rollout_by_tool": {"search": 3.0 * (1 - share), "cat": 3.0 * share},
                  "tool_latency_s_mean_by_tool": {"search": 0.02, "cat": 0.01},
                  "tool_error_rate_by_tool": {"search": 0.0, "cat": 0.25},
                  "completion_tokens_per_rollout": 25.0, "tool_output_tokens_per_rollout": 75.0,
                  "wall_time_s_mean": 0.5, "wall_time_s_max": 0.9, "parse_errors_per_rollout": 0.25,
                  "finish_reasons": {"answered": 0.75, "tool_budget": 0.25},
                  "budget_exhausted_rate": 0.25, "parse_error_rate": 0.25},
        "train": {"loss": 0.5 / step, "kl": None, "grad_norm": 1.0, "learning_rate": 1e-5,
                  "frac_reward_zero_std": 0.5, "rollouts_used": 4, "rollouts_excluded": 0},
    }


def rollout(step: int, i: int, *, reward: float | None, finish: str, tools: list[str], output: str = "result") -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer with a number."},
                                      {"role": "user", "content": f"Question {i}?"}]
    calls = []
    for n, name in enumerate(tools):
        call_id = f"call_{step}_{i}_{n}"
        arguments = json.dumps({"query": f"q{n}"})
        messages.append({"role": "assistant", "content": f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'})
        messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": f"{output} {n}"})
        calls.append({"call_id": call_id, "name": name, "arguments": arguments, "status": "ok", "status_code": 200,
                      "latency_s": 0.012, "bytes": 8, "error": None, "truncated": n == 1, "turn": n + 1})
    messages.append({"role": "assistant", "content": "42"})
    return {"trace_id": f"trace_s{step}_r{i}", "sample_index": i % 2, "reward": reward, "finish_reason": finish,
            "messages": messages, "tool_calls": calls, "prompt_tokens": 20, "completion_tokens": 30,
            "tool_output_tokens": 10, "turns": len(tools) + 1, "parse_errors": 0, "wall_time_s": 0.4,
            # sampled a step ahead: the first turn by the policy before the previous update, the rest after it
            "policy_versions": [max(0, step - 2)] + [step - 1] * len(tools),
            "final_answer": "42", "advantage": 0.5, "excluded": None if reward is not None else "grader_failure",
            "grader_errors": [] if reward is not None else ["grader_server_error"], "grader_details": None,
            "sub_rewards": {"answer": reward} if reward is not None else None}


def report_steps(worker: Worker, job_id: str, steps: range, total: int, *, valid_every: int = 2) -> None:
    """Steps with 4 training rollouts each, as the trainer pushes them."""
    for step in steps:
        records = [
            rollout(step, 0, reward=1.0, finish="answered", tools=["search", "cat"]),
            rollout(step, 1, reward=0.0, finish="tool_budget", tools=["search", "search", "search"]),
            rollout(step, 2, reward=0.5, finish="answered", tools=[]),
            rollout(step, 3, reward=None, finish="answered", tools=["cat"]),
        ]
        response = worker.leased("POST", f"/jobs/{job_id}/rollouts", step=step, split="train", records=records)
        assert response.status_code == 200, response.text
        metrics = step_metrics(step, total, valid=step % valid_every == 0)
        response = worker.leased("PUT", f"/jobs/{job_id}/steps/{step}", metrics=metrics)
        assert response.status_code == 200, response.text


def report_supervised_steps(worker: Worker, job_id: str, steps: range, total: int, *, eval_every: int) -> None:
    """Steps as the supervised trainer pushes them: metrics only, and a checkpoint at each eval step
    carrying that step's metrics."""
    for step in steps:
        metrics = supervised_metrics_data(step, total, eval_every=eval_every)
        response = worker.leased("PUT", f"/jobs/{job_id}/steps/{step}", metrics=metrics)
        assert response.status_code == 200, response.text
        if "valid_loss" in metrics:
            response = worker.leased("PUT", f"/jobs/{job_id}/checkpoints/{step}", path=f"/ckpt/step-{step}",
                                     metrics=metrics)
            assert response.status_code == 200, response.text
