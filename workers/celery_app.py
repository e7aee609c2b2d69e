"""The Celery application shared by the API (which only sends tasks, by name) and the workers.

Importing this module pulls in no web code and no torch.
"""

from __future__ import annotations

from celery import Celery

from app.core.config import Settings, get_settings

RUN_JOB_TASK = "agent_rft.run_job"
DELIVER_WEBHOOK_TASK = "agent_rft.deliver_webhook"
RUN_DIAGNOSTIC_TASK = "agent_rft.run_diagnostic"
RUN_EVAL_TASK = "agent_rft.run_eval"


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    if not settings.broker_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    # Workers import the tasks; the API only sends them by name and never imports this list.
    app = Celery("agent_rft", broker=settings.resolved_broker_url, include=["workers.tasks", "workers.webhooks"])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=settings.training_queue,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        # Training tasks run for hours: the broker must not hand an unacknowledged task to a
        # second worker while the first still runs it (at-least-once, but never run twice at once). The control plane's
        # lease on the job is the real guard; this keeps Redis from racing it.
        broker_transport_options={"visibility_timeout": 24 * 3600} if settings.broker_url else {},
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
    )
    return app


def __getattr__(name: str) -> Celery:
    """`celery_app` for `celery -A workers.celery_app` and `agent-rft worker`, built on first use
    from the environment's settings, so importing this module has no side effects."""
    if name == "celery_app":
        app = make_celery()
        globals()["celery_app"] = app
        return app
    raise AttributeError(name)
