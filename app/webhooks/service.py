"""Webhook endpoints (project-scoped CRUD, rotation, test sends), the deliveries' attempt log
and manual redelivery, and the worker side of a delivery: claim an attempt, report its result.

The control plane decides everything about a delivery (when it is due, what is signed with
which secrets, what a result means for the retry schedule and the endpoint); a worker only
sends the signed request it was handed and reports what came back."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.db import unix, utcnow
from app.core.errors import APIError, bad_request, conflict, not_found
from agent_rft.ids import new_id
from app.core.pagination import ListPage, page
from agent_rft.retry import excerpt
from agent_rft.urls import BlockedURL, guard_url
from app.observability.registry import WEBHOOK_DELIVERY_FAILURES
from app.webhooks.events import EVENT_TYPES, event_body
from app.webhooks.models import DeliveryState, WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent
from app.webhooks.outbox import note_for_dispatch
from app.webhooks.schemas import (
    AttemptObject,
    AttemptReport,
    AttemptReportResult,
    DeletedEndpoint,
    DeliveryClaim,
    DeliveryClaimResponse,
    DeliveryClaimRequest,
    DeliveryObject,
    EndpointCreate,
    EndpointObject,
    EndpointTest,
    EndpointTestResult,
    EndpointUpdate,
    EndpointWithSecret,
    EventTypeList,
    RotateSecret,
)
from app.webhooks.sender import EXCERPT_BYTES, send_attempt
from app.webhooks.signing import new_secret, secret_hint, signed_headers

OLD_SECRET_GRACE = timedelta(hours=24)
EXCERPT_CHARS = EXCERPT_BYTES


def _aware(ts: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; they are UTC here."""
    return ts.replace(tzinfo=timezone.utc) if ts is not None and ts.tzinfo is None else ts


# --- endpoints ----------------------------------------------------------------------------

def _endpoint_object(ep: WebhookEndpoint) -> EndpointObject:
    return EndpointObject(
        id=ep.id, name=ep.name, url=ep.url, event_types=list(ep.event_types),
        signing_secret_hint=ep.signing_secret_hint, created_at=unix(ep.created_at),
        updated_at=unix(ep.updated_at), status="disabled" if ep.disabled_at else "enabled",
        disabled_reason=ep.disabled_reason, disabled_at=unix(ep.disabled_at),
    )


def _with_secret(ep: WebhookEndpoint, secret: str) -> EndpointWithSecret:
    return EndpointWithSecret(**_endpoint_object(ep).model_dump(), signing_secret=secret)


def _set_new_secret(ep: WebhookEndpoint, settings: Settings) -> str:
    """A new signing secret for `ep`, stored sealed with its hint; returns it in plain text, to show once."""
    secret = new_secret()
    ep.signing_secret, ep.signing_secret_hint = secret_box(settings).seal(secret), secret_hint(secret)
    return secret


def _guard(url: str, settings: Settings) -> None:
    try:
        guard_url(url, settings.outbound_allowlist, strict_resolution=False)
    except BlockedURL as exc:
        raise bad_request(f"Webhook url '{url}' is not allowed: {exc}.", param="url", code="url_not_allowed") from exc


def _endpoint_row(session: Session, project_id: str, endpoint_id: str, *, lock: bool = False) -> WebhookEndpoint:
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.project_id == project_id)
    row = session.scalar(stmt.with_for_update() if lock else stmt)
    if row is None:
        raise not_found("webhook endpoint", endpoint_id, param="webhook_endpoint_id")
    return row


def create_endpoint(*, session: Session, settings: Settings, project_id: str,
                    body: EndpointCreate) -> EndpointWithSecret:
    _guard(body.url, settings)
    now = utcnow()
    ep = WebhookEndpoint(id=new_id("we_"), project_id=project_id, name=body.name, url=body.url,
                         event_types=body.event_types, created_at=now, updated_at=now)
    secret = _set_new_secret(ep, settings)
    session.add(ep)
    session.flush()
    return _with_secret(ep, secret)


def list_endpoints(*, session: Session, project_id: str, after: str | None, limit: int) -> ListPage[EndpointObject]:
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id)
    rows, has_more = page(session, stmt, WebhookEndpoint, after=after, limit=limit)
    data = [_endpoint_object(r) for r in rows]
    return ListPage[EndpointObject].of(data, has_more)


def get_endpoint(*, session: Session, project_id: str, endpoint_id: str) -> EndpointObject:
    return _endpoint_object(_endpoint_row(session, project_id, endpoint_id))


def disable_endpoint(session: Session, ep: WebhookEndpoint, reason: str) -> None:
    """Disable `ep` and fail its pending deliveries; new events no longer reach it."""
    now = utcnow()
    ep.disabled_at, ep.disabled_reason = now, reason
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == ep.id, WebhookDelivery.state == DeliveryState.PENDING)
        .values(state=DeliveryState.FAILED, next_attempt_at=None, last_error=f"Not sent: the endpoint was disabled. {reason}")
    )


def update_endpoint(*, session: Session, settings: Settings, project_id: str, endpoint_id: str,
                    body: EndpointUpdate) -> EndpointObject:
    ep = _endpoint_row(session, project_id, endpoint_id, lock=True)
    changed = False
    if body.url is not None and body.url != ep.url:
        _guard(body.url, settings)
        ep.url, changed = body.url, True
    if body.name is not None and body.name != ep.name:
        ep.name, changed = body.name, True
    if body.event_types is not None and body.event_types != list(ep.event_types):
        ep.event_types, changed = body.event_types, True
    if body.status == "enabled" and ep.disabled_at is not None:
        ep.disabled_at = ep.disabled_reason = None
        changed = True
    elif body.status == "disabled" and ep.disabled_at is None:
        disable_endpoint(session, ep, "Disabled by its owner.")
        changed = True
    if changed:
        ep.updated_at = utcnow()
    return _endpoint_object(ep)


def delete_endpoint(*, session: Session, project_id: str, endpoint_id: str) -> DeletedEndpoint:
    ep = _endpoint_row(session, project_id, endpoint_id, lock=True)
    session.delete(ep)
    return DeletedEndpoint(id=endpoint_id)


def rotate_secret(*, session: Session, settings: Settings, project_id: str, endpoint_id: str,
                  body: RotateSecret) -> EndpointWithSecret:
    ep = _endpoint_row(session, project_id, endpoint_id, lock=True)
    now = utcnow()
    if body.keep_old_secret_active_for_24_hours:  # the old secret moves over still sealed
        ep.previous_signing_secret, ep.previous_secret_expires_at = ep.signing_secret, now + OLD_SECRET_GRACE
    else:
        ep.previous_signing_secret = ep.previous_secret_expires_at = None
    secret = _set_new_secret(ep, settings)
    ep.updated_at = now
    return _with_secret(ep, secret)


def signing_secrets(ep: WebhookEndpoint, now: datetime, settings: Settings) -> list[str]:
    """The current secret and, during a rotation window, the previous one, in plain text to sign with."""
    live = [ep.signing_secret]
    expires = _aware(ep.previous_secret_expires_at)
    if ep.previous_signing_secret and expires is not None and expires > now:
        live.append(ep.previous_signing_secret)
    box = secret_box(settings)
    return [box.open(secret) for secret in live]


def event_types() -> EventTypeList:
    return EventTypeList(data=list(EVENT_TYPES))


@dataclass(frozen=True)
class TestSend:
    """A test event ready to send: read from the database, sent without it."""

    endpoint_id: str
    event_type: str
    url: str
    headers: dict[str, str]
    payload: bytes


def prepare_test(*, session: Session, settings: Settings, project_id: str, endpoint_id: str,
                 body: EndpointTest) -> TestSend:
    """A sample event of `body.event_type` for the endpoint, signed like a real one."""
    ep = _endpoint_row(session, project_id, endpoint_id)
    now = utcnow()
    payload = event_body(new_id("evt_"), body.event_type, unix(now), {"id": "ftjob-test"})
    headers = signed_headers(new_id("wh_"), payload, signing_secrets(ep, now, settings), now=now)
    return TestSend(ep.id, body.event_type, ep.url, headers, payload)


async def send_test(test: TestSend, *, settings: Settings) -> EndpointTestResult:
    """Send a prepared test event and answer with the endpoint's status code and whether a real
    delivery would count it as delivered (a 2xx). Test sends are not retried and not logged as
    deliveries."""
    result = await send_attempt(test.url, test.headers, test.payload, allowlist=settings.outbound_allowlist,
                                timeout_s=settings.webhook_timeout_s)
    if result.status_code is None:
        raise APIError(400, f"The test event could not be delivered to '{test.url}': {result.error}.",
                       code="webhook_endpoint_unreachable", param="url")
    error = None if result.succeeded else (
        f"Not delivered: {result.error}. Deliveries count only a 2xx answer as delivered, so real events sent to "
        "this URL would be retried and then fail.")
    return EndpointTestResult(webhook_endpoint_id=test.endpoint_id, event_type=test.event_type,
                              status_code=result.status_code, success=result.succeeded, latency_ms=result.latency_ms,
                              error=error)


# --- deliveries and their attempt log (this service's extension) ---------------------------

def _delivery_objects(session: Session, rows: list[WebhookDelivery]) -> list[DeliveryObject]:
    events = {e.id: e for e in session.scalars(select(WebhookEvent).where(
        WebhookEvent.id.in_([r.event_id for r in rows])))} if rows else {}
    return [
        DeliveryObject(
            id=r.id, webhook_endpoint_id=r.endpoint_id, event_id=r.event_id, event_type=events[r.event_id].type,
            status=r.state, attempt_count=r.attempt_count, created_at=unix(r.created_at),
            next_attempt_at=unix(r.next_attempt_at) if r.state == DeliveryState.PENDING else None,
            delivered_at=unix(r.delivered_at), last_status_code=r.last_status_code, last_error=r.last_error,
            event=json.loads(events[r.event_id].payload),
        )
        for r in rows
    ]


def list_deliveries(*, session: Session, project_id: str, endpoint_id: str, status: str | None, after: str | None,
                    limit: int) -> ListPage[DeliveryObject]:
    ep = _endpoint_row(session, project_id, endpoint_id)
    stmt = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == ep.id)
    if status is not None:
        stmt = stmt.where(WebhookDelivery.state == status)
    rows, has_more = page(session, stmt, WebhookDelivery, after=after, limit=limit)
    data = _delivery_objects(session, rows)
    return ListPage[DeliveryObject].of(data, has_more)


def _delivery_row(session: Session, ep: WebhookEndpoint, delivery_id: str, *, lock: bool = False) -> WebhookDelivery:
    stmt = select(WebhookDelivery).where(WebhookDelivery.id == delivery_id, WebhookDelivery.endpoint_id == ep.id)
    row = session.scalar(stmt.with_for_update() if lock else stmt)
    if row is None:
        raise not_found("webhook delivery", delivery_id, param="delivery_id")
    return row


def get_delivery(*, session: Session, project_id: str, endpoint_id: str, delivery_id: str) -> DeliveryObject:
    ep = _endpoint_row(session, project_id, endpoint_id)
    return _delivery_objects(session, [_delivery_row(session, ep, delivery_id)])[0]


def _attempt_object(a: WebhookAttempt) -> AttemptObject:
    return AttemptObject(id=a.id, delivery_id=a.delivery_id, attempt_number=a.attempt_number, outcome=a.outcome,
                         created_at=unix(a.started_at), status_code=a.status_code, latency_ms=a.latency_ms,
                         response_excerpt=a.response_excerpt, error=a.error, worker_id=a.worker_id)


def list_attempts(*, session: Session, project_id: str, endpoint_id: str, delivery_id: str, after: str | None,
                  limit: int) -> ListPage[AttemptObject]:
    ep = _endpoint_row(session, project_id, endpoint_id)
    delivery = _delivery_row(session, ep, delivery_id)
    stmt = select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery.id)
    rows, has_more = page(session, stmt, WebhookAttempt, after=after, limit=limit)
    data = [_attempt_object(a) for a in rows]
    return ListPage[AttemptObject].of(data, has_more)


def redeliver(*, session: Session, project_id: str, endpoint_id: str, delivery_id: str) -> DeliveryObject:
    """Send a delivery again now, with the same `webhook-id`, and a fresh retry schedule."""
    ep = _endpoint_row(session, project_id, endpoint_id)
    if ep.disabled_at is not None:
        raise conflict(f"Webhook endpoint '{ep.id}' is disabled ({ep.disabled_reason}); enable it first "
                       "(update it with status 'enabled').", code="webhook_endpoint_disabled", param="status")
    delivery = _delivery_row(session, ep, delivery_id, lock=True)
    delivery.state = DeliveryState.PENDING
    delivery.next_attempt_at = utcnow()
    delivery.schedule_start = delivery.attempt_count
    delivery.delivered_at = None
    note_for_dispatch(session, delivery)
    session.flush()
    return _delivery_objects(session, [delivery])[0]


# --- the worker's side: claim an attempt, report its result -------------------------------

def _claim_lock(settings: Settings) -> timedelta:
    """How long a claimed attempt is the worker's alone: the attempt's time limit, and as long
    again for the claim and the report to travel. After that a new claim may resend it."""
    return timedelta(seconds=2 * settings.webhook_timeout_s + 1)


def _max_attempts(settings: Settings) -> int:
    return 1 + len(settings.webhook_retry_schedule_s)


def _fail(delivery: WebhookDelivery, error: str) -> None:
    delivery.state = DeliveryState.FAILED
    delivery.next_attempt_at = None
    delivery.last_error = error


def _locked_delivery(session: Session, delivery_id: str) -> WebhookDelivery:
    row = session.scalar(select(WebhookDelivery).where(WebhookDelivery.id == delivery_id).with_for_update())
    if row is None:
        raise not_found("webhook delivery", delivery_id, param="delivery_id")
    return row


def _note_lost_attempt(session: Session, delivery: WebhookDelivery) -> None:
    attempt = session.scalar(select(WebhookAttempt).where(WebhookAttempt.claim_id == delivery.claim_id))
    if attempt is not None and attempt.outcome == "in_flight":
        attempt.outcome = "lost"
        attempt.error = ("The worker making this attempt stopped before reporting a result (the endpoint may or may "
                         "not have received it); the delivery was sent again.")
    delivery.claim_id = delivery.locked_until = None


def _skip(reason: str) -> DeliveryClaimResponse:
    return DeliveryClaimResponse(action="skip", reason=reason)


def claim_delivery(*, session: Session, settings: Settings, delivery_id: str,
                   body: DeliveryClaimRequest) -> DeliveryClaimResponse:
    """Start an attempt: the signed request to send, or `skip` with the reason when there is
    nothing to send now (delivered, failed, not due yet, or another worker is sending it)."""
    delivery, now = _locked_delivery(session, delivery_id), utcnow()
    delivery.dispatched_at = None  # the broker's message reached a worker
    ep = session.scalar(select(WebhookEndpoint).where(WebhookEndpoint.id == delivery.endpoint_id))
    if delivery.state != DeliveryState.PENDING:
        return _skip(f"the delivery is {delivery.state}")
    if ep is None or ep.disabled_at is not None:
        _fail(delivery, "Not sent: the endpoint was disabled.")
        return _skip("the endpoint is disabled")
    if delivery.next_attempt_at is not None and _aware(delivery.next_attempt_at) > now:
        return _skip("the next attempt is not due yet")
    if delivery.claim_id is not None:
        if _aware(delivery.locked_until) > now:
            return _skip("another worker is sending it")
        _note_lost_attempt(session, delivery)
        if delivery.attempt_count - delivery.schedule_start >= _max_attempts(settings):
            _fail(delivery, f"Gave up after {delivery.attempt_count} attempts whose workers stopped mid-attempt.")
            return _skip("no attempts left")
    delivery.attempt_count += 1
    delivery.claim_id = new_id("whclaim_")
    delivery.locked_until = now + _claim_lock(settings)
    session.add(WebhookAttempt(id=new_id("whatt_"), delivery_id=delivery.id, claim_id=delivery.claim_id,
                               attempt_number=delivery.attempt_count, worker_id=body.worker_id, started_at=now,
                               outcome="in_flight"))
    payload = session.scalar(select(WebhookEvent.payload).where(WebhookEvent.id == delivery.event_id))
    headers = signed_headers(delivery.id, payload, signing_secrets(ep, now, settings), now=now)
    return DeliveryClaimResponse(action="send", attempt=DeliveryClaim(
        delivery_id=delivery.id, claim_id=delivery.claim_id, attempt_number=delivery.attempt_count, url=ep.url,
        headers=headers, body=payload, timeout_s=settings.webhook_timeout_s))


def retry_delay(settings: Settings, failures: int) -> float | None:
    """Seconds until the retry after the `failures`-th failed attempt (1-based), with jitter;
    None once the schedule is used up."""
    schedule = settings.webhook_retry_schedule_s
    if failures > len(schedule):
        return None
    jitter = settings.webhook_retry_jitter
    return schedule[failures - 1] * random.uniform(1 - jitter, 1 + jitter)


def _after_failure(session: Session, settings: Settings, delivery: WebhookDelivery, status_code: int | None,
                   error: str) -> None:
    ep = session.scalar(select(WebhookEndpoint).where(WebhookEndpoint.id == delivery.endpoint_id))
    now = utcnow()
    when = now.strftime("%Y-%m-%d %H:%M:%S UTC")
    if status_code == 410:
        _fail(delivery, error)
        if ep is not None and ep.disabled_at is None:
            disable_endpoint(session, ep, f"The endpoint answered 410 Gone to delivery '{delivery.id}' at {when}.")
        return
    delay = retry_delay(settings, delivery.attempt_count - delivery.schedule_start)
    if delay is not None:
        delivery.next_attempt_at = now + timedelta(seconds=delay)
        return
    _fail(delivery, f"Gave up after {delivery.attempt_count} attempts; the last: {error}")
    if ep is not None and ep.disabled_at is None:
        disable_endpoint(session, ep, f"Every attempt to deliver '{delivery.id}' failed ({delivery.attempt_count} "
                                      f"attempts, the last at {when}: {error}).")


def report_attempt(*, session: Session, settings: Settings, delivery_id: str,
                   body: AttemptReport) -> AttemptReportResult:
    """Record what one attempt got back and decide what follows: delivered, a retry on the
    schedule, or failure (and, after 410 Gone or the last retry, a disabled endpoint). A report
    repeated for the same claim changes nothing."""
    delivery = _locked_delivery(session, delivery_id)
    attempt = session.scalar(select(WebhookAttempt).where(WebhookAttempt.claim_id == body.claim_id,
                                                         WebhookAttempt.delivery_id == delivery.id))
    if attempt is None:
        raise not_found("webhook attempt", body.claim_id, param="claim_id")
    if attempt.outcome in ("in_flight", "lost"):
        succeeded = body.status_code is not None and 200 <= body.status_code < 300
        error = None if succeeded else (body.error or f"the endpoint answered HTTP {body.status_code}")
        attempt.status_code, attempt.latency_ms, attempt.error = body.status_code, body.latency_ms, error
        attempt.response_excerpt = excerpt(body.response_excerpt, EXCERPT_CHARS) if body.response_excerpt else None
        attempt.outcome = "delivered" if succeeded else "failed"
        if not succeeded:
            WEBHOOK_DELIVERY_FAILURES.inc()
        current = delivery.claim_id == body.claim_id
        if current:
            delivery.claim_id = delivery.locked_until = None
        if succeeded and delivery.state != DeliveryState.DELIVERED:  # the endpoint has it, whatever happened meanwhile
            delivery.state, delivery.delivered_at, delivery.next_attempt_at = DeliveryState.DELIVERED, utcnow(), None
            delivery.last_status_code, delivery.last_error = body.status_code, None
        elif not succeeded and current and delivery.state == DeliveryState.PENDING:
            delivery.last_status_code, delivery.last_error = body.status_code, error
            _after_failure(session, settings, delivery, body.status_code, error)
    return AttemptReportResult(delivery_id=delivery.id, status=delivery.state,
                               next_attempt_at=unix(delivery.next_attempt_at) if delivery.state == DeliveryState.PENDING else None)
