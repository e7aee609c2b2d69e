"""`GET /metrics`: Prometheus' text format, for whoever access.py lets in."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.core.deps import SessionDep
from app.observability.access import metrics_refusal
from app.observability.service import exposition


def require_metrics_access(request: Request) -> None:
    refusal = metrics_refusal(request.app.state.settings, authorization=request.headers.get("authorization"),
                              client_host=request.client.host if request.client else None)
    if refusal is not None:
        raise refusal


router = APIRouter(tags=["ops"])


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(require_metrics_access)])
def metrics(session: SessionDep) -> Response:
    return Response(exposition(session), media_type=CONTENT_TYPE_LATEST)
