"""`POST /v1/fine_tuning/alpha/tool/run`, as OpenAI's Agent RFT harness calls it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.core.deps import CurrentKey, SettingsDep, done_with_database
from app.tool_run import service
from app.tool_run.schemas import ToolRunRequest

router = APIRouter(prefix="/v1/fine_tuning/alpha/tool", tags=["tools"])


@router.post("/run")
async def run_tool(body: ToolRunRequest, request: Request, _principal: CurrentKey,
                   settings: SettingsDep) -> dict[str, Any]:
    """Send one function call to `server_url` exactly as a rollout does, and answer with the tool's reply."""
    await done_with_database(request)  # a tool may take minutes
    return await service.run_tool(body, settings=settings)
