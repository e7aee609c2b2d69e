"""`string_check`: compare the rendered input with the rendered reference; 1.0 when the check holds, else 0.0.

Operations as OpenAI defines them: `eq` (equal), `ne` (not equal), `like` (the reference occurs in the
input, case-sensitive) and `ilike` (the same, case-insensitive).
"""

from __future__ import annotations

from typing import Any

from agent_rft.graders.core import GradeResult, GraderContext, Sample, implements
from agent_rft.graders.templating import render


def _holds(operation: str, text: str, reference: str) -> bool:
    if operation == "eq":
        return text == reference
    if operation == "ne":
        return text != reference
    if operation == "like":
        return reference in text
    # ilike: casefold() rather than lower() so that e.g. "STRASSE" matches "straße".
    return reference.casefold() in text.casefold()


@implements("string_check")
async def grade_string_check(
    config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    text = render(config.input, sample, item)
    reference = render(config.reference, sample, item)
    passed = _holds(config.operation, text, reference)
    return GradeResult(name=config.name, type=config.type, reward=1.0 if passed else 0.0, passed=passed)
