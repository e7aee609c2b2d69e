"""Grade many samples concurrently, as the workers do for every rollout of a training step."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from agent_rft.graders.core import ERROR_FLAGS, GradeResult, GraderContext, GraderError, Sample, grade


@dataclass
class BatchGrade:
    index: int
    trace_id: str | None
    reward: float
    passed: bool | None
    errors: list[str]  # the OpenAI error flags that are set; empty when grading succeeded
    details: str | None
    latency_s: float
    result: GradeResult

    @property
    def failed(self) -> bool:
        return bool(self.errors)


def _batch_grade(index: int, trace_id: str | None, result: GradeResult, latency_s: float) -> BatchGrade:
    return BatchGrade(
        index=index, trace_id=trace_id, reward=result.reward, passed=result.passed,
        errors=[flag for flag in ERROR_FLAGS if result.errors.get(flag)],
        details=result.errors.get("details"), latency_s=latency_s, result=result,
    )


async def _grade_one(config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None) -> GradeResult:
    try:
        return await grade(config, sample, item, ctx, trace_id)
    except Exception as exc:  # noqa: BLE001 - grade() already flags failures; this guards one sample against bugs
        return GradeResult(name=config.name, type=config.type, reward=0.0).flag(
            GraderError("other_error", f"{type(exc).__name__}: {exc}")
        )


async def grade_many(
    config: Any, jobs: list[tuple[Sample, dict[str, Any], str | None]], ctx: GraderContext, *, concurrency: int = 32
) -> list[BatchGrade]:
    """Grade every (sample, item, trace_id) with at most `concurrency` in flight.

    Results come back in the order of `jobs`; one sample's failure is its own flagged result,
    never an exception.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    semaphore = asyncio.Semaphore(concurrency)

    async def run(index: int, sample: Sample, item: dict[str, Any], trace_id: str | None) -> BatchGrade:
        async with semaphore:
            started = time.perf_counter()
            result = await _grade_one(config, sample, item or {}, ctx, trace_id)
            return _batch_grade(index, trace_id, result, time.perf_counter() - started)

    return list(await asyncio.gather(*(run(i, *job) for i, job in enumerate(jobs))))
