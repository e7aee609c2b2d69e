"""`method.type = "reinforcement"` in the control plane: the block checked and stored (tools and
graders checked, their header values sealed), a row of its files (a prompt whose tools the job
declares), and how its checkpoints rank (validation reward, higher is better)."""

from __future__ import annotations

from typing import Any

from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.errors import APIError, bad_request
from app.core.urls import BlockedURL, guard_url
from app.graders.service import check_grader_urls, check_python_isolation
from app.jobs import tool_headers
from app.jobs.schemas import Method
from app.jobs.validation import RowRule, check_row, parameters_schema_problem

TYPE = "reinforcement"
# A checkpoint's score among its flattened metrics, and its direction: the trainer's step metrics
# nest it under "scores"; a checkpoint pushed with the plain key counts too.
SCORE_KEYS = (("scores.valid_reward_mean", 1.0), ("valid_reward_mean", 1.0))


def row_rule(declared_tools: set[str]) -> RowRule:
    return lambda row: check_row(row, declared_tools)


def stored_block(method: Method, settings: Settings) -> dict[str, Any]:
    """The stored reinforcement block: tools and graders checked, their header values sealed."""
    if method.reinforcement is None:
        raise APIError(400, "method.reinforcement is required when method.type is 'reinforcement'.",
                       code="missing_required_parameter", param="method.reinforcement")
    seen: set[str] = set()
    for i, tool in enumerate(method.reinforcement.tools):
        if tool.name in seen:
            raise bad_request(f"Tool '{tool.name}' is declared twice.", param=f"method.reinforcement.tools[{i}].name",
                              code="duplicate_tool")
        seen.add(tool.name)
        if tool.parameters is not None:
            problem = parameters_schema_problem(tool.parameters)
            if problem:
                raise bad_request(f"Tool '{tool.name}' parameters {problem}.",
                                  param=f"method.reinforcement.tools[{i}].parameters", code="invalid_tool_schema")
        try:
            guard_url(tool.server_url, settings.outbound_allowlist, strict_resolution=False)
        except BlockedURL as exc:
            raise bad_request(f"Tool '{tool.name}' server_url is not allowed: {exc}.",
                              param=f"method.reinforcement.tools[{i}].server_url", code="url_not_allowed") from exc
    check_grader_urls(method.reinforcement.grader, settings.outbound_allowlist, param="method.reinforcement.grader")
    check_python_isolation(method.reinforcement.grader, required=settings.python_grader_required_isolation,
                           cap=settings.python_grader_isolation_cap, param="method.reinforcement.grader")
    stored = {"type": "reinforcement", "reinforcement": method.reinforcement.model_dump(mode="json")}
    return tool_headers.seal_headers(stored, secret_box(settings))
