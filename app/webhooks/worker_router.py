"""`/internal/v1/webhook_deliveries/...`: the two calls of a worker that sends a delivery (claim
an attempt, report what it got back), authenticated with the shared worker token."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.core.deps import SessionDep, SettingsDep, require_worker
from app.webhooks import service
from app.webhooks.schemas import AttemptReport, AttemptReportResult, DeliveryClaimRequest, DeliveryClaimResponse

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])


@router.post("/webhook_deliveries/{delivery_id}/claim", response_model=DeliveryClaimResponse)
def claim_delivery(delivery_id: str, body: DeliveryClaimRequest, session: SessionDep,
                   settings: SettingsDep) -> DeliveryClaimResponse:
    """Start an attempt: the signed request to send, or why there is nothing to send now."""
    return service.claim_delivery(session=session, settings=settings, delivery_id=delivery_id, body=body)


@router.post("/webhook_deliveries/{delivery_id}/attempts", response_model=AttemptReportResult)
def report_attempt(delivery_id: str, body: AttemptReport, session: SessionDep,
                   settings: SettingsDep) -> AttemptReportResult:
    """What an attempt got back; idempotent per claim."""
    return service.report_attempt(session=session, settings=settings, delivery_id=delivery_id, body=body)
