"""`endpoint`: the customer's own HTTP grader (its wire contract: docs/grader-endpoint.md).

POST {url} with the configured headers, a W3C `traceparent` of the rollout's trace
(agent_rft.tracing) and `{"sample", "item", "trace_id"}`; the reply is
`{"score": <number>}` (`{"reward": <number>}` is accepted too). 5xx, 408, 429, timeouts and
connection errors are retried 3 times with backoff (agent_rft.retry); `rate_limit` caps requests
per second to one URL across every concurrent grading in this process.
"""

from __future__ import annotations

import math
from typing import Any

from aiolimiter import AsyncLimiter

from agent_rft.ids import new_id
from agent_rft.retry import excerpt
from agent_rft.urls import BlockedURL
from agent_rft.graders.core import GradeResult, GraderContext, GraderError, Sample, implements
from agent_rft.graders.judges import Unresponsive, loop_state, post_json
from agent_rft.graders.schemas import EndpointGrader

ATTEMPTS = 4  # the first try and 3 retries


def rate_limiter(ctx: GraderContext, url: str, per_second: int) -> AsyncLimiter:
    """One limiter per URL and rate, shared by every grading on this event loop.

    Requests are spaced 1/rate apart (no initial burst), so no one-second window ever holds
    more than `rate_limit` requests.
    """
    limiters = loop_state(ctx).setdefault("endpoint_limiters", {})
    key = (url, per_second)
    if key not in limiters:
        limiters[key] = AsyncLimiter(1, 1 / per_second)
    return limiters[key]


def _score_from(body: Any) -> float:
    if not isinstance(body, dict):
        raise GraderError("other_error", f'grader endpoint must answer a JSON object {{"score": <number>}}, got {excerpt(str(body))}')
    for key in ("score", "reward"):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise GraderError("other_error", f"grader endpoint answered a non-finite {key}: {value}")
            return float(value)
    raise GraderError("other_error", f'grader endpoint answer has no numeric "score": {excerpt(str(body))}')


@implements("endpoint")
async def grade_endpoint(
    config: EndpointGrader, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    body = {"sample": sample.as_dict(), "item": item, "trace_id": trace_id or new_id("trace_")}
    limiter = rate_limiter(ctx, config.url, config.rate_limit) if config.rate_limit else None
    try:
        response = await post_json(config.url, body, ctx, headers=config.headers, attempts=ATTEMPTS, limiter=limiter,
                                   trace_id=body["trace_id"])
    except BlockedURL as exc:
        raise GraderError("other_error", f"grader endpoint URL not allowed: {exc}") from None
    except Unresponsive as exc:
        raise GraderError("unresponsive_reward_error", f"grader endpoint did not answer: {exc}") from None
    if not response.is_success:  # 4xx is final; a 3xx is not followed (the SSRF guard must see every hop)
        raise GraderError("other_error", f"grader endpoint answered {response.status_code}: {excerpt(response.text)}")
    try:
        answer = response.json()
    except ValueError:
        raise GraderError("other_error", f"grader endpoint answer is not JSON: {excerpt(response.text)}") from None
    score = _score_from(answer)
    result = GradeResult(name=config.name, type=config.type, reward=score, scores={"score": score})
    if config.pass_threshold is not None:
        result.passed = score >= config.pass_threshold
    return result
