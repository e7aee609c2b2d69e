"""The outbox: webhook events are rows written in the transaction that changes a job, so a
crash between the commit and the hand-off to the broker loses nothing.

`record_event` adds the event and one pending delivery per subscribed, enabled endpoint of the
project, and notes the deliveries on the session. After the commit, the hook that
`install_dispatch` puts on the API's session factory hands them to the broker and stamps their
`dispatched_at`. A delivery without that stamp (the broker refused it, the process died first,
or the session had no hook) is handed over by the sweeper (app/webhooks/dispatcher.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import unix, utcnow
from agent_rft.ids import new_id
from app.webhooks.events import EVENT_FOR_STATUS, event_body
from app.webhooks.models import DeliveryState, WebhookDelivery, WebhookEndpoint, WebhookEvent

log = logging.getLogger(__name__)
_TO_SEND = "webhook_deliveries_to_send"


def note_for_dispatch(session: Session, delivery: WebhookDelivery) -> None:
    """Hand `delivery` to the broker once this session commits (if its factory has the hook)."""
    delivery.dispatched_at = None
    session.info.setdefault(_TO_SEND, []).append((delivery.id, delivery.attempt_count))


def record_event(session: Session, *, project_id: str, event_type: str, data: dict[str, Any],
                 at: datetime | None = None) -> WebhookEvent | None:
    """Write the event and its deliveries, if any enabled endpoint of the project subscribes."""
    endpoints = [
        ep for ep in session.scalars(select(WebhookEndpoint).where(
            WebhookEndpoint.project_id == project_id, WebhookEndpoint.disabled_at.is_(None)))
        if event_type in ep.event_types
    ]
    if not endpoints:
        return None
    at = at or utcnow()
    webhook_event = WebhookEvent(id=new_id("evt_"), project_id=project_id, type=event_type, created_at=at)
    webhook_event.payload = event_body(webhook_event.id, event_type, unix(at), data)
    session.add(webhook_event)
    session.flush()  # the deliveries' foreign key needs the event row first
    for endpoint in endpoints:
        delivery = WebhookDelivery(id=new_id("wh_"), event_id=webhook_event.id, endpoint_id=endpoint.id,
                                   state=DeliveryState.PENDING, attempt_count=0, schedule_start=0, next_attempt_at=at,
                                   created_at=at)
        session.add(delivery)
        note_for_dispatch(session, delivery)
    return webhook_event


def job_status_changed(session: Session, *, project_id: str, job_id: str, status: str) -> None:
    """Called by app/jobs/state.py::transition for every status change."""
    event_type = EVENT_FOR_STATUS.get(status)
    if event_type is not None:
        record_event(session, project_id=project_id, event_type=event_type, data={"id": job_id})


def install_dispatch(factory: sessionmaker[Session], send: Callable[[str], Any]) -> None:
    """After each commit of a session made by `factory`, hand the deliveries it noted to the
    broker with `send(delivery_id)` and stamp them as handed over; one the broker refused stays
    unstamped, and the sweeper sends it at its next round."""

    def after_commit(session: Session) -> None:
        pending = session.info.pop(_TO_SEND, None)
        if not pending:
            return
        sent = []
        for delivery_id, attempt_count in pending:
            try:
                send(delivery_id)
            except Exception as exc:  # noqa: BLE001 - never fail the request whose commit already happened
                log.warning("could not hand webhook delivery %s to the broker (the sweeper will): %s", delivery_id, exc)
                continue
            sent.append((delivery_id, attempt_count))
        if sent:
            _stamp_dispatched(factory, sent)

    def after_soft_rollback(session: Session, previous_transaction: Any) -> None:
        if not previous_transaction.nested:  # the whole transaction is gone, its deliveries too
            session.info.pop(_TO_SEND, None)

    event.listen(factory, "after_commit", after_commit)
    event.listen(factory, "after_soft_rollback", after_soft_rollback)


def _stamp_dispatched(factory: sessionmaker[Session], sent: list[tuple[str, int]]) -> None:
    """Record the hand-over, unless a worker already claimed the delivery (its attempt count
    moved): a stamp on a delivery waiting for its retry would hold the retry back."""
    d = WebhookDelivery
    try:
        with factory.begin() as session:
            for delivery_id, attempt_count in sent:
                session.execute(update(d).where(
                    d.id == delivery_id, d.attempt_count == attempt_count, d.claim_id.is_(None),
                    d.dispatched_at.is_(None),
                ).values(dispatched_at=utcnow()))
    except Exception:  # noqa: BLE001 - unstamped, the sweeper sends them again: a duplicate task, harmless
        log.exception("could not record that webhook deliveries were handed to the broker")
