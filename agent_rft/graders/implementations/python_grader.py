"""`python`: the customer's source defines `grade(sample, item) -> float`; the reward is what it
returns. It runs in agent_rft.graders.sandbox: a separate interpreter without network, with the
deployment's time and memory limits (AGENT_RFT_PYTHON_GRADER_TIMEOUT_S / _MEMORY_MB), reading
nothing outside the standard library and its own temporary directory. Below the deployment's
least isolation (AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION) it does not run: python_grader_server_error.

`sample` is the model's output as templates see it (output_text, output_json, output_tools,
choices, trajectory, usage) and `item` is the dataset row, both as plain JSON values.
`image_tag` (OpenAI's choice of grader image) is accepted and ignored: there is one sandbox.
"""

from __future__ import annotations

from typing import Any

from agent_rft.graders.core import GradeResult, GraderContext, Sample, implements
from agent_rft.graders.sandbox import SandboxLimits, run_grade_function


@implements("python")
async def grade_python(
    config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    limits = SandboxLimits(timeout_s=ctx.python_timeout_s, memory_mb=ctx.python_memory_mb,
                           min_isolation=ctx.python_min_isolation, isolation_cap=ctx.python_isolation_cap)
    reward = await run_grade_function(config.source, sample.as_dict(), item, limits)
    return GradeResult(name=config.name, type=config.type, reward=reward)
