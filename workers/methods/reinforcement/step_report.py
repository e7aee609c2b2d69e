"""What a training step reports: its metrics event `data` (OpenAI's `scores`, `usage`, `errors`
and `timing`, plus this service's `tools` and `train` blocks, docs/training.md) and where its
seconds went. The dashboard's charts draw these names (app/dashboard/charts.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from workers.engine.grading import GradedRollout, mean_or_none, sub_reward_means
from workers.engine.summary import summarize
from workers.methods.reinforcement.update import UpdateStats


@dataclass
class SamplingCost:
    """The rollout engine's own account of one run: seconds in prefill and decode, tokens fed."""

    timings: dict[str, float]
    prefill_tokens: int

    @classmethod
    def of(cls, engine: Any) -> SamplingCost:
        return cls(dict(engine.generation_timings), engine.prefill_tokens)

    def plus(self, other: SamplingCost) -> SamplingCost:
        """Two runs' costs together (a step that drew more prompts ran the engine again)."""
        timings = {key: self.timings.get(key, 0.0) + other.timings.get(key, 0.0)
                   for key in {*self.timings, *other.timings}}
        return SamplingCost(timings, self.prefill_tokens + other.prefill_tokens)


@dataclass
class GraderLoad:
    """The graders' outbound backpressure (endpoint graders and remote judges, all URLs
    together): answers that asked to wait, seconds waited, the lowest concurrency limit now."""

    throttled: int
    throttle_wait_s: float
    concurrency: int | None

    @classmethod
    def of(cls, ctx: Any) -> GraderLoad:
        from agent_rft.graders.judges import backpressure_stats

        urls = backpressure_stats(ctx).values()
        return cls(int(sum(u["throttled"] for u in urls)), float(sum(u["throttle_wait_s"] for u in urls)),
                   min((int(u["concurrency"]) for u in urls), default=None))

    def since(self, earlier: GraderLoad) -> dict[str, Any]:
        """This step's share: the counts since `earlier`, the limit as it is now."""
        return {"throttled": self.throttled - earlier.throttled,
                "throttle_wait_s": self.throttle_wait_s - earlier.throttle_wait_s, "concurrency": self.concurrency}


class StepClock:
    """Wall-clock seconds of a step's phases, each lap from the end of the previous one."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self.last = now - self.last, now

    def since_last(self) -> float:
        return time.perf_counter() - self.last

    def laps(self, phases: dict[str, float]) -> None:
        """Phases that end now, timed by whoever ran them (a step's sampling and its grading)."""
        self.seconds.update(phases)
        self.last = time.perf_counter()

    def report(self, sampling: SamplingCost, update: UpdateStats,
               ahead: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
        """`ahead`: the sampling and grading seconds of a batch sampled while the previous step
        updated; the step itself only waited for what was left of them (its `sampling`)."""
        step = {**self.seconds, "full_iteration": self.last - self.started}
        if not ahead:
            return {"step": step, "breakdown": step_breakdown(step, sampling.timings, update)}
        return {"step": step, "breakdown": step_breakdown(step, None, update),
                "ahead": {**ahead, **{k.removesuffix("_s"): v for k, v in sampling.timings.items()}}}


def step_breakdown(timing: dict[str, float], generation: dict[str, float] | None,
                   update: UpdateStats) -> dict[str, float]:
    """A step's seconds split where they went; the parts add up to the step. Sampling: prefill (the
    first forward of each generation batch), decode (every later forward and its sampling), and the
    rest, the wall time the model sat idle (tool calls, batching waits, tokenizing). The update:
    forward, backward, and the rest (optimizer step, collation). `generation` None: the batch was
    sampled ahead, and the step's sampling is only its wait for it (StepClock.report)."""
    if generation is None:
        sampling = {"waiting_for_batch_ahead": timing["sampling"]}
    else:
        prefill, decode = generation.get("prefill_s", 0.0), generation.get("decode_s", 0.0)
        sampling = {"prefill": prefill, "decode": decode,
                    "tool_wait_and_other": max(0.0, timing["sampling"] - prefill - decode)}
    return {
        **sampling, "grading": timing["grading"], "forward": update.forward_s, "backward": update.backward_s,
        "optimizer_and_other": max(0.0, timing["training"] - update.forward_s - update.backward_s),
        "eval": timing["eval"],
    }


def staleness(records: list[Any], *, updated_version: int) -> dict[str, Any]:
    """How far the policies that sampled the step's turns lag the one its update starts from
    (`updated_version`): per turn, in versions."""
    versions = [v for record in records for v in record.policy_versions]
    if not versions:
        return {"policy_version": updated_version, "policy_versions": [], "staleness_mean": None,
                "staleness_max": None}
    lags = [updated_version - v for v in versions]
    return {"policy_version": min(versions), "policy_versions": sorted(set(versions)),
            "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags)}


def step_metrics(*, step: int, total_steps: int, graded: list[GradedRollout], stats: UpdateStats, n_used: int,
                 zero_spread_groups: int, n_groups: int, timing: dict[str, dict[str, float]],
                 sampling: SamplingCost, valid: dict[str, Any] | None, learning_rate: float,
                 graders: dict[str, Any] | None = None, updated_version: int = 0,
                 sampled_ahead: bool = False) -> dict[str, Any]:
    """`n_groups`: the prompts the step drew; `updated_version`: the policy version its update
    started from, which the turns' versions lag (`staleness`)."""
    records = [g.record for g in graded]
    scores: dict[str, Any] = {"train_reward_mean": mean_or_none([g.reward for g in graded if g.reward is not None])}
    if sub := sub_reward_means(graded):
        scores["train_sub_rewards"] = sub
    if valid is not None:
        scores["valid_reward_mean"] = valid["reward_mean"]
        if valid["sub_rewards"]:
            scores["valid_sub_rewards"] = valid["sub_rewards"]
    return {
        "step": step,
        "total_steps": total_steps,
        "scores": scores,
        "usage": {"completion_tokens": sum(r.completion_tokens for r in records),
                  "tool_output_tokens": sum(r.tool_output_tokens for r in records),
                  "prompt_tokens": sum(r.prompt_tokens for r in records),
                  "prefill_tokens": sampling.prefill_tokens},
        "errors": {"tool_failures": sum(1 for g in graded if g.excluded == "tool_failure"),
                   "grader_failures": sum(1 for g in graded if g.excluded == "grader_failure"),
                   "parse_errors": sum(r.parse_errors for r in records)},
        "timing": timing,
        "tools": summarize(records),
        "graders": graders or {},
        "train": {"loss": stats.loss, "kl": stats.kl, "grad_norm": stats.grad_norm,
                  "logprob_mismatch": stats.logprob_mismatch, "clip_fraction": stats.clip_fraction,
                  "importance_clip_fraction": stats.importance_clip_fraction,
                  "learning_rate": learning_rate,
                  "frac_reward_zero_std": zero_spread_groups / n_groups,
                  "rollouts_used": n_used,
                  "rollouts_excluded": sum(1 for g in graded if g.excluded is not None),
                  "prompts_drawn": n_groups, "sampled_ahead": sampled_ahead,
                  **staleness(records, updated_version=updated_version)},
    }
