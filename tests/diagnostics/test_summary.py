"""The pure summary logic: signal classes, per-sample results, summary, load projection, verdict."""

from __future__ import annotations

import pytest

from app.diagnostics.summary import (
    build_result,
    project_load,
    sample_results,
    signal_class,
    zero_signal_samples,
)


def rollout(sample: int, run: int, reward: float | None, *, calls=(), excluded=None, finish="answered",
            tokens=10, wall=0.5) -> dict:
    return {"sample_index": sample, "run_index": run, "trace_id": f"trace_{sample}_{run}", "reward": reward,
            "finish_reason": finish,
            "data": {"tool_calls": [{"name": name, "status": status, "turn": turn} for name, status, turn in calls],
                     "prompt_tokens": 50, "completion_tokens": tokens, "tool_output_tokens": 5 * len(calls),
                     "wall_time_s": wall, "excluded": excluded, "parse_errors": 0}}


@pytest.mark.parametrize(("rewards", "expected"), [
    ([0.0, 0.0, 0.0], "always_0"), ([1.0, 1.0], "always_1"), ([0.0, 1.0, 0.0], "mixed"),
    ([0.4, 0.4, 0.4], "constant"), ([0.2, 0.3], "mixed"), ([], "ungraded"), ([1.0], "always_1"),
])
def test_signal_class(rewards, expected):
    assert signal_class(rewards) == expected


def test_per_sample_results_keep_every_run_in_order():
    rows = [rollout(0, 1, 1.0, calls=[("search", "ok", 1)]), rollout(0, 0, 0.0),
            rollout(0, 2, None, excluded="tool_failure", finish="tool_failure", calls=[("search", "failed", 1)])]
    (sample,) = sample_results(rows)
    assert sample["scores"] == [0.0, 1.0, None]
    assert sample["mean"] == 0.5 and sample["std"] == 0.5 and sample["signal"] == "mixed"
    assert sample["tool_calls"] == [{}, {"search": 1}, {"search": 1}]
    assert sample["finish_reasons"] == ["answered", "answered", "tool_failure"]
    assert sample["excluded"] == [None, None, "tool_failure"]
    assert sample["rollout_ids"] == ["trace_0_0", "trace_0_1", "trace_0_2"]
    assert sample["tokens"][1] == {"prompt": 50, "completion": 10, "tool_output": 5}
    assert sample["latency_s"] == [0.5, 0.5, 0.5]


def test_summary_shares_rates_and_verdict():
    rows = []
    for run in range(3):
        rows += [rollout(0, run, 0.0), rollout(1, run, 1.0, calls=[("search", "ok", 1), ("search", "ok", 1)]),
                 rollout(2, run, float(run % 2), calls=[("search", "client_error", 1), ("cat", "ok", 2)]),
                 rollout(3, run, 1.0 if run else 0.0)]
    result = build_result(rows, runs_per_sample=3, load_basis=None)
    summary = result["summary"]
    assert summary["samples"] == 4 and summary["rollouts"] == 12
    assert summary["share_always_0"] == 0.25 and summary["share_always_1"] == 0.25 and summary["share_mixed"] == 0.5
    assert summary["signal"]["mixed"]["count"] == 2
    assert summary["mean_tool_calls_per_rollout"] == pytest.approx(12 / 12)
    assert summary["tool_calls_per_rollout_by_tool"] == {"cat": 0.25, "search": 0.75}
    assert summary["tool_error_rate"] == pytest.approx(3 / 12)
    assert summary["tool_failure_rate"] == 0 and summary["grader_error_rate"] == 0
    assert summary["mean_reward"] == pytest.approx(sum(r["reward"] for r in rows) / 12)
    verdict = result["verdict"]
    assert verdict["level"] == "ok" and verdict["message"].startswith("50% of samples have signal")
    assert "25% always score 0" in verdict["message"] and "25% always score 1" in verdict["message"]
    # The best and the worst run of the first mixed sample, then one of the next.
    assert verdict["example_rollout_ids"] == ["trace_2_1", "trace_2_0", "trace_3_2"]
    assert zero_signal_samples(result["samples"]) == [0, 1]


def test_every_sample_zero_names_three_transcripts():
    rows = [rollout(s, r, 0.0) for s in range(5) for r in range(2)]
    verdict = build_result(rows, runs_per_sample=2, load_basis=None)["verdict"]
    assert verdict["level"] == "error" and verdict["signal_share"] == 0
    assert verdict["message"].startswith("Every sample scores 0: the task is too hard or the grader is wrong")
    assert "here are 3 transcripts" in verdict["message"]
    assert verdict["example_rollout_ids"] == ["trace_0_0", "trace_1_0", "trace_2_0"]


def test_every_sample_one_and_nothing_graded():
    ones = build_result([rollout(s, r, 1.0) for s in range(2) for r in range(2)], runs_per_sample=2, load_basis=None)
    assert ones["verdict"]["message"].startswith("Every sample scores 1")
    broken = build_result([rollout(0, r, None, excluded="grader_failure") for r in range(3)], runs_per_sample=3,
                          load_basis=None)
    assert broken["summary"]["grader_error_rate"] == 1.0
    assert broken["verdict"]["message"].startswith("No rollout could be graded")
    assert broken["verdict"]["example_rollout_ids"] == ["trace_0_0", "trace_0_1", "trace_0_2"]
    assert any("Grading failed for 100%" in note for note in broken["verdict"]["notes"])


def test_low_signal_is_a_warning():
    rows = [rollout(s, r, 0.0) for s in range(9) for r in range(2)] + [rollout(9, 0, 0.0), rollout(9, 1, 1.0)]
    verdict = build_result(rows, runs_per_sample=2, load_basis=None)["verdict"]
    assert verdict["level"] == "warning" and verdict["message"].startswith("10% of samples have signal")
    assert "drop_zero_signal" in verdict["message"]


def test_load_projection_formula():
    # Two rollouts: one calls search twice in one turn and cat once; the other calls search once.
    data = [rollout(0, 0, 1.0, calls=[("search", "ok", 1), ("search", "ok", 1), ("cat", "ok", 2)])["data"],
            rollout(0, 1, 0.0, calls=[("search", "ok", 1)])["data"]]
    basis = {"tool_max_concurrency": 16, "settings": [
        {"compute_multiplier": 1.0, "batch_size": 8, "group_size": 4, "configured": True},
        {"compute_multiplier": 0.5, "batch_size": 8, "group_size": 2}]}
    one, half = project_load(data, basis)
    assert one["rollouts_per_step"] == 32 and one["configured"] and not half["configured"]
    search = one["tools"]["search"]
    assert search["calls_per_rollout"] == 1.5 and search["calls_per_step"] == 48
    assert search["max_simultaneous_per_rollout"] == 2
    assert search["peak_concurrency_uncapped"] == 64 and search["peak_concurrency"] == 16
    assert one["tools"]["cat"] == {"calls_per_rollout": 0.5, "calls_per_step": 16, "calls_per_step_max": 16,
                                   "max_simultaneous_per_rollout": 1,
                                   "peak_concurrency": 16, "peak_concurrency_uncapped": 32, "max_concurrency": 16,
                                   "requests_per_s": 32.0, "rate_limit": None, "throttled": False,
                                   "step_tool_seconds_at_limit": None, "step_seconds_unthrottled": 0.5,
                                   "cache_hit_rate": 0.0, "calls_saved_per_step": 0.0, "endpoint_calls_per_step": 16}
    assert half["tools"]["cat"]["peak_concurrency"] == 16 and half["tools"]["search"]["calls_per_step"] == 24
    assert not one["sampling_overlaps_update"] and one["rollouts_at_once"] == 32 and one["prompts_per_step_max"] == 8
    assert project_load(data, None) == []


def test_the_load_projection_of_a_job_sampling_ahead_with_refills():
    """max_staleness 1: at an eval step the eval's rollouts sample beside the step ahead's, so the
    peak counts both; refill_zero_spread: a step may draw up to 4 times its prompts and their calls."""
    data = [rollout(0, 0, 1.0, calls=[("search", "ok", 1)])["data"], rollout(0, 1, 0.0, calls=[])["data"]]
    basis = {"tool_max_concurrency": None, "max_staleness": 1, "prompts_per_step_factor": 4, "settings": [
        {"compute_multiplier": 1.0, "batch_size": 8, "group_size": 4, "eval_samples": 16, "configured": True}]}
    (projected,) = project_load(data, basis)
    assert projected["sampling_overlaps_update"] and projected["rollouts_at_once"] == 32 + 16
    assert projected["prompts_per_step_max"] == 32
    search = projected["tools"]["search"]
    assert search["peak_concurrency"] == 48 and search["calls_per_step"] == 16 and search["calls_per_step_max"] == 64


def test_the_load_projection_counts_the_calls_the_cache_saves():
    """1 of the 4 search calls came from the tool-result cache: 48 calls a step, 12 saved."""
    data = [rollout(0, 0, 1.0, calls=[("search", "ok", 1), ("search", "ok", 2)])["data"],
            rollout(0, 1, 0.0, calls=[("search", "ok", 1), ("search", "ok", 2)])["data"]]
    data[1]["tool_calls"][0]["cached"] = True
    basis = {"tool_max_concurrency": 16, "settings": [
        {"compute_multiplier": 1.0, "batch_size": 6, "group_size": 4, "configured": True}]}
    search = project_load(data, basis)[0]["tools"]["search"]
    assert search["calls_per_step"] == 48 and search["cache_hit_rate"] == 0.25
    assert search["calls_saved_per_step"] == 12 and search["endpoint_calls_per_step"] == 36


def test_the_verdict_warns_when_training_would_exceed_a_tools_rate_limit():
    """32 rollouts a step × 1.5 search calls in a 0.5 s rollout ≈ 96 requests/s against a
    rate_limit of 20/s: the step would queue for 48 / 20 = 2.4 s of search calls."""
    rows = []
    for run in range(2):
        rows += [rollout(0, run, float(run), calls=[("search", "ok", 1), ("search", "ok", 2), ("cat", "ok", 3)]),
                 rollout(1, run, float(run), calls=[("search", "ok", 1)])]
    basis = {"tool_max_concurrency": 16, "tool_limits": {"search": {"rate_limit": 20, "max_concurrency": 4}},
             "settings": [{"compute_multiplier": 1.0, "batch_size": 8, "group_size": 4, "configured": True}]}
    result = build_result(rows, runs_per_sample=2, load_basis=basis)
    search = result["summary"]["load_projection"][0]["tools"]["search"]
    assert search["requests_per_s"] == pytest.approx(96.0) and search["throttled"]
    assert search["step_tool_seconds_at_limit"] == pytest.approx(2.4)
    assert search["peak_concurrency"] == 4 and search["max_concurrency"] == 4  # the tool's own cap
    assert not result["summary"]["load_projection"][0]["tools"]["cat"]["throttled"]  # no limit of its own
    verdict = result["verdict"]
    assert verdict["level"] == "warning"  # every sample has signal: only the load warns
    (note,) = [n for n in verdict["notes"] if "throttled" in n]
    assert "'search'" in note and "96.0 requests/s" in note and "rate_limit of 20/s" in note and "2.4 s" in note

    basis["tool_limits"]["search"]["rate_limit"] = 500
    relaxed = build_result(rows, runs_per_sample=2, load_basis=basis)["verdict"]
    assert relaxed["level"] == "ok" and not any("throttled" in n for n in relaxed["notes"])
