"""Every table, imported in one place so Alembic (and tests) see the whole metadata."""

from app.auth.models import ApiKey, Project
from app.core.db import Base
from app.files.models import StoredFile
from app.idempotency.models import IdempotencyRecord
from app.internal.models import JobMetric, JobRollout, JobStep, WorkerEventKey
from app.jobs.models import Checkpoint, Job, JobEvent

__all__ = [
    "ApiKey", "Base", "Checkpoint", "IdempotencyRecord", "Job", "JobEvent", "JobMetric", "JobRollout", "JobStep",
    "Project", "StoredFile", "WorkerEventKey",
]
