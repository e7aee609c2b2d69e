from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from app.core.deps import CurrentKey, done_with_database
from app.graders import service
from agent_rft.graders.core import GraderContext
from agent_rft.graders.judges import close_http_client
from app.graders.service import GraderRunRequest, GraderValidateRequest


@asynccontextmanager
async def _close_grader_connections(app: FastAPI) -> AsyncIterator[None]:
    """Merged into the app's lifespan by include_router: close pooled grader connections on shutdown."""
    yield
    ctx = getattr(app.state, "grader_context", None)
    if ctx is not None:
        await close_http_client(ctx)


router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"], lifespan=_close_grader_connections)


def _grader_context(request: Request) -> GraderContext:
    """One context per app, so that HTTP clients, rate limiters and a loaded judge are shared."""
    state = request.app.state
    if getattr(state, "grader_context", None) is None:
        state.grader_context = service.grader_context(state.settings)
    return state.grader_context


@router.post("/run")
async def run_grader(body: GraderRunRequest, request: Request, _principal: CurrentKey) -> dict[str, Any]:
    """Grade one model sample with a grader, as a training job would."""
    await done_with_database(request)  # a grader may take seconds (an endpoint, a model judge)
    return await service.run_grader(body, _grader_context(request))


@router.post("/validate")
def validate_grader(body: GraderValidateRequest, request: Request, _principal: CurrentKey) -> dict[str, Any]:
    """Check a grader configuration without running it."""
    return service.validate_grader(body, _grader_context(request))
