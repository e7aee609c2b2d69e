"""One tool call, sent as a rollout sends it (workers/engine/tools_client.py: the same body, headers,
`Idempotency-Key`, `traceparent`, timeouts, retries and outbound guard), and its answer.

- The tool answered 2xx: its JSON reply as it is when it has an `output`; otherwise
  `{"type": "function_call_output", "call_id", "output"}` with the output a model would see.
- It answered 4xx: the same, with that output: in training the agent reads it and may recover.
- It failed (5xx, no connection, a redirect) after its retries: 502 `tool_unavailable`; it timed out:
  504 `tool_timeout`. The URL is refused by the outbound guard: 400 `url_not_allowed`.
Every answer carries `x_agent_rft` (status, HTTP status, attempts, latency)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from app.core.config import Settings
from app.core.errors import APIError, bad_request
from agent_rft.ids import new_id
from agent_rft.urls import BlockedURL, guard_url
from app.tool_run.schemas import ToolRunRequest
from workers.engine.tools_client import ToolClient, ToolEndpoint, ToolResult


async def run_tool(body: ToolRunRequest, *, settings: Settings) -> dict[str, Any]:
    try:
        await asyncio.to_thread(guard_url, body.server_url, settings.outbound_allowlist, strict_resolution=False)
    except BlockedURL as exc:
        raise bad_request(f"server_url is not allowed: {exc}.", param="server_url", code="url_not_allowed") from exc
    arguments = body.arguments if isinstance(body.arguments, str) else json.dumps(body.arguments)
    call_id = body.call_id or new_id("call_")
    endpoint = ToolEndpoint(name=body.name, server_url=body.server_url, headers=body.headers, timeout_s=body.timeout,
                            retries=body.retries)
    async with ToolClient([endpoint], allowlist=settings.outbound_allowlist) as client:
        result = await client.call(trace_id=body.trace_id or new_id("trace_"), call_id=call_id, name=body.name,
                                   arguments_json=arguments, item=body.item or {}, item_id=body.id)
    return answer(result, url=body.server_url)


def answer(result: ToolResult, *, url: str) -> dict[str, Any]:
    """What tool/run answers for a finished call (see the module docstring)."""
    if result.status == "blocked":
        raise bad_request(f"server_url is not allowed: {result.error}.", param="server_url", code="url_not_allowed")
    if result.status == "failed":
        timed_out = (result.error or "").startswith("timeout")
        raise APIError(504 if timed_out else 502,
                       f"The tool server at {url} {'did not answer in time' if timed_out else 'failed'} after "
                       f"{result.attempts} attempt(s): {result.error}.",
                       code="tool_timeout" if timed_out else "tool_unavailable", type="server_error")
    reply = _json_object(result.reply)
    if reply is None or "output" not in reply:
        reply = {"type": "function_call_output", "call_id": result.call_id, "output": result.output}
    return {**reply, "x_agent_rft": {"status": result.status, "status_code": result.status_code,
                                     "attempts": result.attempts, "latency_ms": round(1000 * result.latency_s),
                                     "truncated": result.truncated}}


def _json_object(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
