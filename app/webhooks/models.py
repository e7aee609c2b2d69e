"""Webhook endpoints and the outbox: one event per job status change (or checkpoint), one
delivery per subscribed endpoint, one attempt row per try."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import DateTime, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, BigIntPK, JSONType, StorableText, utcnow


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    url: Mapped[str] = mapped_column(Text)
    event_types: Mapped[list[str]] = mapped_column(JSONType)
    # Sealed (app/core/crypto.py: the control plane signs with it, so it is encrypted, not hashed),
    # shown only at creation and rotation; the hint is what every read shows of it.
    signing_secret: Mapped[str] = mapped_column(Text)
    signing_secret_hint: Mapped[str] = mapped_column(String(64))
    # After a rotation with keep_old_secret_active_for_24_hours, deliveries carry both signatures.
    previous_signing_secret: Mapped[str | None] = mapped_column(Text, nullable=True)
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Set when the endpoint answered 410 Gone, kept failing, or was disabled by its owner.
    disabled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    disabled_reason: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEvent(Base):
    """An event as sent: `payload` is the exact JSON body every delivery and attempt carries."""

    __tablename__ = "webhook_events"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String(128))
    payload: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DeliveryState(StrEnum):
    """Where a delivery stands: due (or being attempted), received by the endpoint, or given up."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class WebhookDelivery(Base):
    """One event to one endpoint. Its id is the `webhook-id` header of every attempt.

    `state` is pending, delivered or failed. A pending delivery is due at `next_attempt_at`;
    `dispatched_at` says a task for it was handed to the broker (cleared when a worker claims
    it); `claim_id`/`locked_until` mark the attempt a worker is making right now."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_state_next_attempt_at", "state", "next_attempt_at"),)

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"), index=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    state: Mapped[str] = mapped_column(String(16), default=DeliveryState.PENDING.value)
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    # attempt_count when the retry schedule last (re)started: at creation and at a manual redeliver.
    schedule_start: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    claim_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    locked_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookAttempt(Base):
    """The log of one try, written when a worker claims the delivery and completed by its report:
    when, what came back (status, latency, the start of the body) or what went wrong. A worker
    that dies mid-try leaves a row whose outcome says so."""

    __tablename__ = "webhook_attempts"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True)
    claim_id: Mapped[str] = mapped_column(String(64), unique=True)
    attempt_number: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    latency_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response_excerpt: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    error: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    # in_flight (a worker is trying now), delivered, failed, or lost (its worker died before reporting).
    outcome: Mapped[str] = mapped_column(String(16), default="in_flight")
