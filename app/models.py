"""Every table, imported in one place so Alembic (and tests) see the whole metadata."""

from app.auth.models import ApiKey, IntegrationSecret, Project
from app.core.db import Base
from app.diagnostics.models import Diagnostic, DiagnosticRollout
from app.evals.models import Eval, EvalOutputItem, EvalRun
from app.files.models import StoredFile
from app.idempotency.models import IdempotencyRecord
from app.jobs.models import Checkpoint, Job, JobEvent, JobMetric, JobRollout, JobStep, WorkerEventKey
from app.responses.models import StoredResponse
from app.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent

__all__ = [
    "ApiKey", "Base", "Checkpoint", "Diagnostic", "DiagnosticRollout", "Eval", "EvalOutputItem", "EvalRun", "IdempotencyRecord", "IntegrationSecret", "Job",
    "JobEvent",
    "JobMetric", "JobRollout", "JobStep", "Project", "StoredFile", "StoredResponse", "WebhookAttempt", "WebhookDelivery",
    "WebhookEndpoint", "WebhookEvent", "WorkerEventKey",
]
