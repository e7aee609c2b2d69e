"""`multi`: grade the sample with every sub-grader in `graders` at once, then combine their rewards
with the `calculate_output` formula (agent_rft.graders.formula: + - * / ^, min max abs floor ceil exp
sqrt log, the sub-graders' keys as names; never Python's eval).

- `sub_rewards` and `scores` map each key to its sub-grader's reward.
- A sub-grader's error flags are OR-ed into the multi grader's flags, and the multi reward is 0:
  a formula such as `1 - a` must not turn a failed grading into a full reward.
- A formula that does not parse is a `formula_parse_error` (job creation refuses it already);
  a formula whose value is undefined for these rewards (division by zero, log of 0, overflow,
  a non-finite result) is an `other_error`. Both score 0.
- Token usage of model-judged sub-graders adds up.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent_rft.graders import core
from agent_rft.graders.core import DETAIL_FIELDS, ERROR_FLAGS, GradeResult, GraderContext, GraderError, Sample, implements
from agent_rft.graders.formula import FormulaError, FormulaMathError, evaluate, parse_formula


@implements("multi")
async def grade_multi(
    config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    try:
        formula = parse_formula(config.calculate_output, config.graders.keys())
    except FormulaError as exc:
        raise GraderError("formula_parse_error", f"calculate_output: {exc}") from None
    keys = list(config.graders)
    subs = await asyncio.gather(*(core.grade(config.graders[k], sample, item, ctx, trace_id) for k in keys))
    by_key = dict(zip(keys, subs))
    result = GradeResult(name=config.name, type=config.type, reward=0.0)
    result.sub_rewards = {key: sub.reward for key, sub in by_key.items()}
    result.scores = dict(result.sub_rewards)
    _add_usage(result, subs)
    if _merge_errors(result, by_key):
        return result
    try:
        result.reward = evaluate(formula, result.sub_rewards)
    except FormulaMathError as exc:
        result.flag(GraderError("other_error", f"calculate_output: {exc}"))
    return result


def _merge_errors(result: GradeResult, by_key: dict[str, GradeResult]) -> bool:
    """OR the sub-graders' flags into `result`; True when any sub-grader failed."""
    failed = {key: sub for key, sub in by_key.items() if sub.failed}
    for sub in failed.values():
        for flag in ERROR_FLAGS:
            if sub.errors.get(flag):
                result.errors[flag] = True
                detail = DETAIL_FIELDS.get(flag)
                if detail and not result.errors.get(detail):
                    result.errors[detail] = sub.errors.get(detail)
    if failed:
        result.errors["details"] = "; ".join(f"{key}: {sub.errors.get('details')}" for key, sub in failed.items())
        result.reward = 0.0
    return bool(failed)


def _add_usage(result: GradeResult, subs: list[GradeResult]) -> None:
    counted = [sub.token_usage for sub in subs if sub.token_usage is not None]
    result.token_usage = sum(counted) if counted else None
    for sub in subs:
        for model, usage in sub.model_token_usage.items():
            total = result.model_token_usage.setdefault(model, {})
            for key, count in usage.items():
                total[key] = total.get(key, 0) + count
        result.sampled_model_name = result.sampled_model_name or sub.sampled_model_name
