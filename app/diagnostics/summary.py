"""What a variance diagnostic found, from its stored rollouts: per-sample results, the summary,
the projected tool load and a plain-language verdict. Pure functions over plain data (no
database, no torch); docs/diagnostics.md describes every field.

A sample's *signal* class, from the rewards of its graded runs (runs excluded for a tool or
grader failure have no reward):
- `mixed`: the rewards differ (max - min > EPSILON): group-relative advantages are non-zero, so
  training learns from this sample;
- `always_0`: every reward is 0 (or below); `always_1`: every reward is 1 (or above);
- `constant`: every reward is the same other value (e.g. 0.5 each time): no spread either;
- `ungraded`: no run could be graded.
Only `mixed` samples carry a gradient; the others are "zero-signal".
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from statistics import mean, pstdev
from typing import Any

EPSILON = 1e-9
SIGNAL_CLASSES = ("mixed", "always_0", "always_1", "constant", "ungraded")
ZERO_SIGNAL = frozenset(SIGNAL_CLASSES) - {"mixed"}
EXAMPLES = 3  # rollout ids quoted by the verdict
LOW_SIGNAL_SHARE = 0.25  # below this share of mixed samples the verdict is a warning
FAILURE_NOTE_RATE = 0.1  # tool or grader failure rates above this get a note in the verdict


def signal_class(rewards: Sequence[float]) -> str:
    if not rewards:
        return "ungraded"
    low, high = min(rewards), max(rewards)
    if high - low > EPSILON:
        return "mixed"
    if high <= EPSILON:
        return "always_0"
    if low >= 1 - EPSILON:
        return "always_1"
    return "constant"


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _calls_by_tool(data: Mapping[str, Any]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for call in data.get("tool_calls") or []:
        if isinstance(call, Mapping) and call.get("name"):
            counts[str(call["name"])] += 1
    return dict(sorted(counts.items()))


def _max_simultaneous_by_tool(data: Mapping[str, Any]) -> dict[str, int]:
    """The most calls to each tool that one turn of this rollout made at once (the engine runs a
    turn's calls concurrently)."""
    per_turn: Counter[tuple[str, Any]] = Counter()
    for call in data.get("tool_calls") or []:
        if isinstance(call, Mapping) and call.get("name"):
            per_turn[(str(call["name"]), call.get("turn"))] += 1
    peak: dict[str, int] = {}
    for (name, _turn), count in per_turn.items():
        peak[name] = max(peak.get(name, 0), count)
    return peak


def sample_results(rollouts: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per sample, runs in order. Each rollout is a stored row: `sample_index`,
    `run_index`, `trace_id`, `reward`, `finish_reason` and `data` (the worker's record)."""
    by_sample: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for rollout in rollouts:
        by_sample[int(rollout["sample_index"])].append(rollout)
    results = []
    for index in sorted(by_sample):
        runs = sorted(by_sample[index], key=lambda r: int(r["run_index"]))
        scores = [_finite(r.get("reward")) for r in runs]
        graded = [s for s in scores if s is not None]
        data = [r.get("data") or {} for r in runs]
        results.append({
            "sample_index": index,
            "runs": len(runs),
            "scores": scores,
            "mean": mean(graded) if graded else None,
            "std": pstdev(graded) if graded else None,
            "signal": signal_class(graded),
            "rollout_ids": [r["trace_id"] for r in runs],
            "tool_calls": [_calls_by_tool(d) for d in data],
            "tokens": [{"prompt": d.get("prompt_tokens", 0), "completion": d.get("completion_tokens", 0),
                        "tool_output": d.get("tool_output_tokens", 0)} for d in data],
            "latency_s": [_finite(d.get("wall_time_s")) for d in data],
            "finish_reasons": [r.get("finish_reason") for r in runs],
            "excluded": [d.get("excluded") for d in data],
        })
    return results


def _share(count: int, total: int) -> float:
    return count / total if total else 0.0


def summarize(samples: Sequence[Mapping[str, Any]], rollouts: Sequence[Mapping[str, Any]],
              load_basis: Mapping[str, Any] | None) -> dict[str, Any]:
    n_samples, n_rollouts = len(samples), len(rollouts)
    classes = Counter(s["signal"] for s in samples)
    data = [r.get("data") or {} for r in rollouts]
    rewards = [v for r in rollouts if (v := _finite(r.get("reward"))) is not None]
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for record in data:
        for call in record.get("tool_calls") or []:
            if isinstance(call, Mapping) and call.get("name"):
                calls[str(call["name"])] += 1
                if call.get("status") not in ("ok", "skipped"):  # skipped: the diagnostic's own choice
                    errors[str(call["name"])] += 1
    tool_failures = sum(1 for d in data if d.get("excluded") == "tool_failure")
    grader_failures = sum(1 for d in data if d.get("excluded") == "grader_failure")
    finish = Counter(r.get("finish_reason") or "unknown" for r in rollouts)
    latencies = [v for d in data if (v := _finite(d.get("wall_time_s"))) is not None]
    stds = [s["std"] for s in samples if s.get("std") is not None]
    return {
        "samples": n_samples,
        "rollouts": n_rollouts,
        "signal": {name: {"count": classes[name], "share": _share(classes[name], n_samples)}
                   for name in SIGNAL_CLASSES},
        "share_mixed": _share(classes["mixed"], n_samples),
        "share_always_0": _share(classes["always_0"], n_samples),
        "share_always_1": _share(classes["always_1"], n_samples),
        "zero_signal_samples": n_samples - classes["mixed"],
        "mean_reward": mean(rewards) if rewards else None,
        "mean_within_sample_std": mean(stds) if stds else None,
        "mean_tool_calls_per_rollout": _share(sum(calls.values()), n_rollouts),
        "tool_calls_per_rollout_by_tool": {name: _share(count, n_rollouts) for name, count in sorted(calls.items())},
        "tool_error_rate": _share(sum(errors.values()), sum(calls.values())),
        "tool_error_rate_by_tool": {name: _share(errors[name], calls[name]) for name in sorted(calls)},
        "tool_failure_rate": _share(tool_failures, n_rollouts),
        "grader_error_rate": _share(grader_failures, n_rollouts - tool_failures),
        "parse_error_rate": _share(sum(1 for d in data if d.get("parse_errors")), n_rollouts),
        "finish_reasons": {reason: _share(count, n_rollouts) for reason, count in sorted(finish.items())},
        "prompt_tokens_per_rollout": _mean_of(data, "prompt_tokens"),
        "completion_tokens_per_rollout": _mean_of(data, "completion_tokens"),
        "tool_output_tokens_per_rollout": _mean_of(data, "tool_output_tokens"),
        "latency_s_mean": mean(latencies) if latencies else None,
        "latency_s_max": max(latencies) if latencies else None,
        "load_projection": project_load(data, load_basis),
    }


def _mean_of(data: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [v for d in data if (v := _finite(d.get(key))) is not None]
    return mean(values) if values else None


def project_load(data: Sequence[Mapping[str, Any]], load_basis: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Per compute_multiplier the worker resolved (batch size and group size exactly as the
    trainer would), the load on each tool endpoint during one training step:

    - rollouts per step = batch_size × group_size (the trainer runs them all at once);
    - calls per step = rollouts per step × measured calls per rollout to that tool;
    - peak concurrency = min(the client's in-flight cap per tool,
                             rollouts per step × the most calls to that tool one turn made at once);
    - requests per second = calls per step / the mean rollout's wall time (a step runs its
      rollouts at once, so its calls spread over about one rollout's time), compared with the
      tool's own `rate_limit`: over it, the calls queue and the tool alone takes at least
      calls per step / rate_limit seconds of every step.

    Sampling ahead (`max_staleness` 1), a step's rollouts run while the previous step updates and
    evaluates: the endpoint sees that rate without a pause for the update, and at an eval step the
    eval's rollouts sample beside the step's (peak concurrency counts both). With
    `refill_zero_spread` a step may draw up to `prompts_per_step_factor` times its prompts
    (`calls_per_step_max`).
    """
    if not load_basis or not data:
        return []
    n = len(data)
    seconds = _mean_of(data, "wall_time_s")
    calls: Counter[str] = Counter()
    simultaneous: dict[str, int] = {}
    for record in data:
        calls.update(_calls_by_tool(record))
        for name, peak in _max_simultaneous_by_tool(record).items():
            simultaneous[name] = max(simultaneous.get(name, 0), peak)
    cap = load_basis.get("tool_max_concurrency")
    limits = load_basis.get("tool_limits") or {}
    hits = _cache_hits(data)
    overlapped = bool(load_basis.get("max_staleness"))
    factor = int(load_basis.get("prompts_per_step_factor") or 1)
    projection = []
    for setting in load_basis.get("settings") or []:
        rollouts = int(setting["batch_size"]) * int(setting["group_size"])
        at_once = rollouts + (int(setting.get("eval_samples") or 0) if overlapped else 0)
        tools = {}
        for name in sorted(calls):
            demand = at_once * simultaneous.get(name, 1)
            own = limits.get(name) or {}
            tool_cap = own.get("max_concurrency") or cap
            per_step = rollouts * calls[name] / n
            tools[name] = {"calls_per_rollout": calls[name] / n, "calls_per_step": per_step,
                           "calls_per_step_max": per_step * factor,
                           "max_simultaneous_per_rollout": simultaneous.get(name, 1),
                           "peak_concurrency": min(demand, tool_cap) if isinstance(tool_cap, int) else demand,
                           "peak_concurrency_uncapped": demand, "max_concurrency": tool_cap,
                           **_cache_savings(per_step, hits[name] / calls[name]),
                           **_rate_against_limit(per_step, seconds, own.get("rate_limit"))}
        projection.append({"compute_multiplier": setting["compute_multiplier"], "batch_size": setting["batch_size"],
                           "group_size": setting["group_size"], "rollouts_per_step": rollouts,
                           "rollouts_at_once": at_once, "prompts_per_step_max": int(setting["batch_size"]) * factor,
                           "sampling_overlaps_update": overlapped,
                           "configured": bool(setting.get("configured")), "tools": tools})
    return projection


def _cache_hits(data: Sequence[Mapping[str, Any]]) -> Counter[str]:
    """Calls per tool answered from the tool-result cache (read-only tools with `cache`)."""
    hits: Counter[str] = Counter()
    for record in data:
        for call in record.get("tool_calls") or []:
            if isinstance(call, Mapping) and call.get("name") and call.get("cached"):
                hits[str(call["name"])] += 1
    return hits


def _cache_savings(calls_per_step: float, hit_rate: float) -> dict[str, float]:
    """The measured hit rate, and what it leaves the endpoint per step. Measured over the
    diagnostic's groups (runs_per_sample rollouts of a prompt): training's groups differ in size."""
    saved = calls_per_step * hit_rate
    return {"cache_hit_rate": hit_rate, "calls_saved_per_step": saved,
            "endpoint_calls_per_step": calls_per_step - saved}


def _rate_against_limit(calls_per_step: float, step_seconds: float | None, rate_limit: float | None
                        ) -> dict[str, Any]:
    rate = calls_per_step / step_seconds if step_seconds else None
    throttled = bool(rate_limit and rate is not None and rate > rate_limit)
    return {"requests_per_s": rate, "rate_limit": rate_limit, "throttled": throttled,
            "step_tool_seconds_at_limit": calls_per_step / rate_limit if rate_limit else None,
            "step_seconds_unthrottled": step_seconds}


def throttled_tools(projection: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The tools whose projected requests per second at the job's own compute_multiplier exceed
    their `rate_limit`, with their projection."""
    configured = next((p for p in projection if p.get("configured")), None)
    if configured is None:
        return []
    return [(name, tool) for name, tool in configured["tools"].items() if tool.get("throttled")]


def _pct(share: float) -> str:
    return f"{share * 100:.0f}%"


def _examples(samples: Sequence[Mapping[str, Any]], signal: str | None = None) -> list[str]:
    """One run of each of the first samples of a class (the best and worst run of a mixed one)."""
    ids: list[str] = []
    for sample in samples:
        if signal is not None and sample["signal"] != signal:
            continue
        if sample["signal"] == "mixed":
            scored = [(s, i) for s, i in zip(sample["scores"], sample["rollout_ids"]) if s is not None]
            picks = [max(scored)[1], min(scored)[1]]
        else:
            picks = sample["rollout_ids"][:1]
        ids += [p for p in picks if p not in ids]
        if len(ids) >= EXAMPLES:
            break
    return ids[:EXAMPLES]


def _excluded_examples(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    ids = [rid for s in samples for rid, why in zip(s["rollout_ids"], s["excluded"]) if why]
    return ids[:EXAMPLES]


def verdict(samples: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], runs_per_sample: int) -> dict[str, Any]:
    """`level` (ok, warning, error), a plain-language `message`, `signal_share` and
    `example_rollout_ids` to open with `GET …/diagnostics/{id}/rollouts`."""
    n = len(samples)
    share = summary.get("share_mixed", 0.0) if n else 0.0
    result = {"signal_share": share, "notes": _notes(summary)}
    if not n:
        return {**result, "level": "error", "message": "No sample was run, so there is nothing to judge.",
                "example_rollout_ids": []}
    counts = {name: summary["signal"][name]["count"] for name in SIGNAL_CLASSES}
    if counts["ungraded"] == n:
        return {**result, "level": "error", "example_rollout_ids": _excluded_examples(samples),
                "message": (f"No rollout could be graded ({_pct(summary['tool_failure_rate'])} ended in a tool "
                            f"failure, grading failed for {_pct(summary['grader_error_rate'])} of the rest): fix the tools or "
                            f"the grader before training — here are {min(EXAMPLES, n)} transcripts.")}
    if counts["always_0"] == n:
        return {**result, "level": "error", "example_rollout_ids": _examples(samples, "always_0"),
                "message": ("Every sample scores 0: the task is too hard or the grader is wrong — here are "
                            f"{min(EXAMPLES, n)} transcripts.")}
    if counts["always_1"] == n:
        return {**result, "level": "error", "example_rollout_ids": _examples(samples, "always_1"),
                "message": ("Every sample scores 1: the model already solves the task (or the grader accepts "
                            f"anything), so training has nothing to learn — here are {min(EXAMPLES, n)} transcripts.")}
    breakdown = ", ".join(f"{_pct(counts[name] / n)} {label}" for name, label in
                          (("always_0", "always score 0"), ("always_1", "always score 1"),
                           ("constant", "always get the same other score"), ("ungraded", "could not be graded"))
                          if counts[name])
    if not counts["mixed"]:
        return {**result, "level": "error", "example_rollout_ids": _examples(samples),
                "message": (f"No sample has signal: over {runs_per_sample} runs no sample's scores differ "
                            f"({breakdown}), so every group-relative advantage is 0 and training cannot learn.")}
    message = (f"{_pct(share)} of samples have signal ({counts['mixed']} of {n} got different scores over "
               f"{runs_per_sample} runs): that is where learning can happen.")
    if breakdown:
        message += f" The rest carry no gradient: {breakdown}."
    low_signal = share < LOW_SIGNAL_SHARE
    level = "warning" if low_signal or throttled_tools(summary.get("load_projection") or []) else "ok"
    if low_signal:
        message += (" With so few samples with signal, most of each step is wasted: consider dropping the "
                    "zero-signal samples (x_open_model.diagnostic.drop_zero_signal) or making the task easier.")
    return {**result, "level": level, "message": message, "example_rollout_ids": _examples(samples, "mixed")}


def _notes(summary: Mapping[str, Any]) -> list[str]:
    notes = []
    if summary.get("tool_failure_rate", 0) > FAILURE_NOTE_RATE:
        notes.append(f"{_pct(summary['tool_failure_rate'])} of rollouts ended in a tool failure (a tool call still "
                     "failed after retries); training excludes those rollouts and fails a step above 50%.")
    if summary.get("grader_error_rate", 0) > FAILURE_NOTE_RATE:
        notes.append(f"Grading failed for {_pct(summary['grader_error_rate'])} of rollouts; training excludes them "
                     "and fails a step above 50%.")
    if summary.get("parse_error_rate", 0) > FAILURE_NOTE_RATE:
        notes.append(f"{_pct(summary['parse_error_rate'])} of rollouts had a tool-call parse error.")
    for name, tool in throttled_tools(summary.get("load_projection") or []):
        notes.append(
            f"Training would be throttled by tool '{name}': about {tool['requests_per_s']:.1f} requests/s at the "
            f"job's compute_multiplier, above its rate_limit of {tool['rate_limit']:g}/s. Its "
            f"{tool['calls_per_step']:.0f} calls per step then take at least {tool['step_tool_seconds_at_limit']:.1f} s "
            f"of every step (about {tool['step_seconds_unthrottled']:.1f} s unthrottled): raise the limit, lower "
            "compute_multiplier or batch_size, or cache the tool's results.")
    return notes


def build_result(rollouts: Sequence[Mapping[str, Any]], *, runs_per_sample: int,
                 load_basis: Mapping[str, Any] | None) -> dict[str, Any]:
    """Everything the API shows once a diagnostic has ended: samples, summary, verdict."""
    samples = sample_results(rollouts)
    summary = summarize(samples, rollouts, load_basis)
    return {"samples": samples, "summary": summary, "verdict": verdict(samples, summary, runs_per_sample)}


def zero_signal_samples(samples: Iterable[Mapping[str, Any]]) -> list[int]:
    """Row indexes of the diagnosed samples that carry no gradient (what drop_zero_signal drops)."""
    return sorted(int(s["sample_index"]) for s in samples if s["signal"] in ZERO_SIGNAL)
