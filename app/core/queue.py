"""Hand-off of jobs to the workers: a Celery message per run, sent by task name so the API
never imports worker code."""

from __future__ import annotations

import uuid

from app.core.config import Settings


class JobQueue:
    def __init__(self, settings: Settings) -> None:
        from workers.celery_app import make_celery

        self.settings = settings
        self.celery = make_celery(settings)

    def _send_leased(self, task: str, run_id: str) -> str:
        """One leased run's task, on the training queue: jobs, diagnostics and eval runs share the workers."""
        task_id = f"{run_id}.{uuid.uuid4().hex[:12]}"
        self.celery.send_task(
            task, args=[run_id], task_id=task_id, queue=self.settings.training_queue,
            retry=True, retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2},
        )
        return task_id

    def enqueue_job(self, job_id: str) -> str:
        from workers.celery_app import RUN_JOB_TASK

        return self._send_leased(RUN_JOB_TASK, job_id)

    def enqueue_diagnostic(self, diagnostic_id: str) -> str:
        from workers.celery_app import RUN_DIAGNOSTIC_TASK

        return self._send_leased(RUN_DIAGNOSTIC_TASK, diagnostic_id)

    def enqueue_eval_run(self, run_id: str) -> str:
        from workers.celery_app import RUN_EVAL_TASK

        return self._send_leased(RUN_EVAL_TASK, run_id)

    def enqueue_webhook(self, delivery_id: str) -> str:
        """Hand one webhook delivery to the workers. No publish retries here: a delivery the broker
        did not take is handed over again by the API's webhook sweeper (app/webhooks/dispatcher.py)."""
        from workers.celery_app import DELIVER_WEBHOOK_TASK

        task_id = f"{delivery_id}.{uuid.uuid4().hex[:12]}"
        self.celery.send_task(DELIVER_WEBHOOK_TASK, args=[delivery_id], task_id=task_id,
                              queue=self.settings.webhook_queue, retry=False)
        return task_id

    def close(self) -> None:
        self.celery.close()
