"""What `/metrics` reads from the database at scrape time: every API replica answers the same
numbers for them, so they are gauges, never summed across replicas."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.db import unix, utcnow
from app.jobs.models import Job
from app.jobs.state import JobStatus
from app.observability.registry import API_REGISTRY
from app.webhooks.models import DeliveryState, WebhookDelivery


def _age_s(since: datetime | None, now: datetime) -> float:
    """Seconds from `since` to `now`; 0 when there is nothing waiting."""
    return 0.0 if since is None else max(0.0, float(unix(now) - unix(since)))


def job_families(session: Session, now: datetime) -> list[Metric]:
    """Jobs per status (every status, zeros included, so a series never vanishes), the queue's depth
    and how long its oldest job has waited: since it was handed to the workers, or since it was
    created while it has not been handed over yet."""
    counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
    jobs = GaugeMetricFamily("agent_rft_jobs", "Fine-tuning jobs by status.", labels=["status"])
    for status in JobStatus:
        jobs.add_metric([status.value], counts.get(status.value, 0))
    oldest = session.scalar(select(func.min(func.coalesce(Job.enqueued_at, Job.created_at)))
                            .where(Job.status == JobStatus.QUEUED.value))
    return [
        jobs,
        GaugeMetricFamily("agent_rft_queue_depth", "Jobs queued for a worker.",
                          value=counts.get(JobStatus.QUEUED.value, 0)),
        GaugeMetricFamily("agent_rft_queue_oldest_age_seconds", "Age of the oldest queued job (0 when none).",
                          value=_age_s(oldest, now)),
    ]


def webhook_families(session: Session, now: datetime) -> list[Metric]:
    """The outbox: deliveries not yet delivered nor given up, and the age of the oldest (its lag)."""
    pending, oldest = session.execute(
        select(func.count(), func.min(WebhookDelivery.created_at))
        .where(WebhookDelivery.state == DeliveryState.PENDING.value)).one()
    return [
        GaugeMetricFamily("agent_rft_webhook_outbox_pending", "Webhook deliveries not yet delivered nor given up.",
                          value=pending),
        GaugeMetricFamily("agent_rft_webhook_outbox_lag_seconds",
                          "Age of the oldest undelivered webhook delivery (0 when none).", value=_age_s(oldest, now)),
    ]


class _Snapshot:
    """A collector of metric families already read (prometheus_client's Collector protocol)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(session: Session) -> bytes:
    """The Prometheus text format: the database's view now, then this process's counters."""
    now = utcnow()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([*job_families(session, now), *webhook_families(session, now)]))
    return generate_latest(registry) + generate_latest(API_REGISTRY)
