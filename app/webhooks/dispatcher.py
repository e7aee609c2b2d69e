"""The sweeper: hands due webhook deliveries to the broker. It covers everything the
after-commit hand-off (app/webhooks/outbox.py) does not: retries whose time has come, tasks
the broker refused or lost, deliveries whose worker died mid-attempt, and, at start-up, the
deliveries a crashed process committed but never handed over."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import utcnow
from app.webhooks.models import DeliveryState, WebhookDelivery

log = logging.getLogger(__name__)
BATCH = 500


def dispatch_due(factory: sessionmaker[Session], send: Callable[[str], Any], *, redispatch_after_s: float,
                 startup: bool = False, now: datetime | None = None) -> list[str]:
    """Hand every pending, due delivery that no worker holds and that was not handed over
    recently (at start-up: whether or not it was) to the broker; return their ids."""
    now = now or utcnow()
    d = WebhookDelivery
    stmt = select(d).where(
        d.state == DeliveryState.PENDING, d.next_attempt_at <= now, or_(d.locked_until.is_(None), d.locked_until < now))
    if not startup:
        stmt = stmt.where(or_(d.dispatched_at.is_(None), d.dispatched_at < now - timedelta(seconds=redispatch_after_s)))
    sent: list[str] = []
    with factory.begin() as session:
        # SKIP LOCKED: a delivery being claimed right now, or swept by another API process, waits a round.
        due = stmt.order_by(d.next_attempt_at).limit(BATCH).with_for_update(skip_locked=True)
        for delivery in session.scalars(due):
            try:
                send(delivery.id)
            except Exception as exc:  # noqa: BLE001 - the broker is down: try again next round
                log.warning("could not hand webhook deliveries to the broker: %s", exc)
                break
            delivery.dispatched_at = now
            sent.append(delivery.id)
    return sent


def sweep(factory: sessionmaker[Session], send: Callable[[str], Any], *, redispatch_after_s: float,
          first: bool) -> list[str]:
    """One round of the sweeper (app/core/lifecycle.PeriodicLoop): the first, at start-up, hands
    over every pending due delivery, whether or not it was handed over before."""
    sent = dispatch_due(factory, send, redispatch_after_s=redispatch_after_s, startup=first)
    if sent and first:
        log.info("handed %d pending webhook deliveries to the broker at start-up", len(sent))
    return sent
