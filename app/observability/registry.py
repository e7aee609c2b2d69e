"""The API process's own counters: events that happen in this process and leave no row to count
later. A registry of its own, so that tests running several processes' code in one interpreter
never mix the API's metrics with a worker's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

API_REGISTRY = CollectorRegistry(auto_describe=True)

LEASE_EXPIRIES = Counter(
    "agent_rft_lease_expiries", "Jobs re-queued by the watchdog because their worker stopped heartbeating.",
    registry=API_REGISTRY)
WEBHOOK_DELIVERY_FAILURES = Counter(
    "agent_rft_webhook_delivery_failures", "Webhook delivery attempts reported failed (non-2xx or no answer).",
    registry=API_REGISTRY)
API_BUSY_REFUSALS = Counter(
    "agent_rft_api_busy_refusals", "Requests answered 503 server_busy: no turn at the database within the queue timeout.",
    registry=API_REGISTRY)
