"""The `deliver_webhook` Celery task: one attempt of one webhook delivery.

The worker needs no database credentials and never sees a signing secret: it claims the
attempt from the control plane (which answers with the URL, the exact body and the signed
headers), sends it through the SSRF-guarded client, and reports what came back. The control
plane owns the rest: retries (its sweeper re-sends the task when the next attempt is due), the
attempt log, disabling endpoints. A worker killed mid-attempt leaves a claim that expires; the
sweeper then hands the delivery to another worker, with the same `webhook-id`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from workers.celery_app import DELIVER_WEBHOOK_TASK, celery_app
from app.webhooks.schemas import AttemptReport, AttemptReportResult, DeliveryClaimResponse
from workers.control_client import ControlPlaneClient, ControlPlaneError, worker_id

log = logging.getLogger(__name__)
# A control plane that cannot be reached: retry the task a few times, then leave it to the sweeper.
CONTROL_PLANE_RETRY_S = 15


class WebhookClient(ControlPlaneClient):
    def claim_delivery(self, delivery_id: str, worker_id: str) -> DeliveryClaimResponse:
        return self._answer(DeliveryClaimResponse, "POST", f"/webhook_deliveries/{delivery_id}/claim",
                            json={"worker_id": worker_id})

    def report_attempt(self, delivery_id: str, report: AttemptReport) -> AttemptReportResult:
        return self._answer(AttemptReportResult, "POST", f"/webhook_deliveries/{delivery_id}/attempts",
                            json=report.model_dump(mode="json"))


def deliver(client: WebhookClient, delivery_id: str, worker_id: str, allowlist: list[str]) -> dict[str, Any]:
    from app.webhooks.sender import send_attempt

    claim = client.claim_delivery(delivery_id, worker_id)
    if claim.action != "send" or claim.attempt is None:
        log.info("webhook delivery %s: nothing to send (%s)", delivery_id, claim.reason)
        return {"delivery_id": delivery_id, "status": "skipped", "reason": claim.reason}
    attempt = claim.attempt
    result = asyncio.run(send_attempt(attempt.url, attempt.headers, attempt.body, allowlist=allowlist,
                                      timeout_s=attempt.timeout_s))
    outcome = client.report_attempt(delivery_id, AttemptReport(
        claim_id=attempt.claim_id, status_code=result.status_code, latency_ms=result.latency_ms,
        response_excerpt=result.response_excerpt, error=result.error))
    log.info("webhook delivery %s attempt %s: %s (%s)", delivery_id, attempt.attempt_number,
             result.status_code or result.error, outcome.status)
    return {"delivery_id": delivery_id, "status": str(outcome.status), "status_code": result.status_code}


@celery_app.task(name=DELIVER_WEBHOOK_TASK, bind=True, max_retries=4, ignore_result=True)
def deliver_webhook(self, delivery_id: str) -> dict[str, Any]:  # noqa: ANN001
    from app.core.config import get_settings

    settings = get_settings()
    client = WebhookClient(settings.api_url, settings.worker_token.get_secret_value())
    try:
        return deliver(client, delivery_id, worker_id(), list(settings.outbound_allowlist))
    except (httpx.TransportError, ControlPlaneError) as exc:
        if isinstance(exc, ControlPlaneError) and exc.status_code < 500:
            log.warning("webhook delivery %s: the control plane refused (%s)", delivery_id, exc)
            return {"delivery_id": delivery_id, "status": "refused", "reason": str(exc)}
        raise self.retry(countdown=CONTROL_PLANE_RETRY_S, exc=exc) from exc
    finally:
        client.close()
