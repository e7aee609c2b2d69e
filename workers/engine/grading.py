"""Grading rollouts, the one way training, evaluation and the variance diagnostic do it: each
rollout's grader sample graded with the job's grader (app/graders, batched by grade_many),
failures kept on the rollout as `excluded` with their flags, and the report of a graded rollout
that the control plane stores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Any

from agent_rft.graders.batch import BatchGrade, grade_many
from agent_rft.graders.core import GraderContext, Sample
from workers import spans
from workers.metrics import record_grading
from workers.engine.rollout import RolloutRecord


def load_grader(grader: Any) -> Any:
    """A grader config from its stored JSON (a job's `method.reinforcement.grader`); a config
    already validated passes through."""
    if not isinstance(grader, Mapping):
        return grader
    from pydantic import TypeAdapter

    from agent_rft.graders.schemas import Grader

    return TypeAdapter(Grader).validate_python(grader)


@dataclass
class GradedRollout:
    record: RolloutRecord
    reward: float | None = None  # None when excluded
    excluded: str | None = None  # "tool_failure" | "grader_failure"
    grade: BatchGrade | None = None
    advantage: float | None = None

    def report(self) -> dict[str, Any]:
        """The record for the worker: RolloutRecord.summary() plus reward and advantage."""
        data = self.record.summary()
        data.update(reward=self.reward, advantage=self.advantage, excluded=self.excluded)
        if self.grade is not None:
            data["grader_errors"] = self.grade.errors
            data["grader_details"] = self.grade.details
            data["sub_rewards"] = self.grade.result.sub_rewards or None
        return data


async def grade_rollouts(grader: Any, ctx: GraderContext, records: list[RolloutRecord],
                         items: list[dict[str, Any]], *, grade_tool_failures: bool = False) -> list[GradedRollout]:
    """Grade every rollout that did not end in a tool failure (training and the diagnostic
    exclude those), or every rollout (evaluation scores what the model answered regardless);
    mark the ones to exclude."""
    graded = [GradedRollout(r, excluded="tool_failure" if r.tool_failure and not grade_tool_failures else None)
              for r in records]
    todo = [(g, item) for g, item in zip(graded, items) if g.excluded is None]
    jobs = [(Sample.from_model_sample(g.record.grader_sample()), item, g.record.trace_id) for g, item in todo]
    grader_type = grader_type_of(grader)
    for (rollout, _), result in zip(todo, await grade_many(grader, jobs, ctx) if jobs else []):
        record_grading(grader_type, result.latency_s, failed=result.failed)
        spans.grader_call_span(rollout.record.trace_id, grader_type, result.latency_s, result.failed)
        rollout.grade = result
        if result.failed:
            rollout.excluded = "grader_failure"
        else:
            rollout.reward = float(result.reward)
    return graded


def grader_type_of(grader: Any) -> str:
    """The grader's type (`string_check`, `multi`, ...): a metrics label of few values, unlike its name."""
    kind = grader.get("type") if isinstance(grader, Mapping) else getattr(grader, "type", None)
    return str(kind or "unknown")


def mean_or_none(values: Sequence[float]) -> float | None:
    return mean(values) if values else None


def sub_reward_means(graded: Sequence[GradedRollout]) -> dict[str, float]:
    """A multi grader's sub-graders, each averaged over the graded rollouts that report it."""
    by_key: dict[str, list[float]] = {}
    for rollout in graded:
        if rollout.reward is not None and rollout.grade is not None:
            for key, value in (rollout.grade.result.sub_rewards or {}).items():
                if isinstance(value, (int, float)):
                    by_key.setdefault(key, []).append(float(value))
    return {key: mean(values) for key, values in sorted(by_key.items())}
