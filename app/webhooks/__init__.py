"""Webhooks: endpoints (/v1/webhook_endpoints), the outbox of job events, signed deliveries
with retries and an attempt log (docs/webhooks.md)."""
