"""The event types this service sends and the JSON body of an event.

OpenAI's fine-tuning events keep OpenAI's names and shape, so `client.webhooks.unwrap` parses
them into its typed models. This service's own events carry the `x_agent_rft.` prefix (like the
`x_open_model` extension object): no OpenAI client mistakes them for OpenAI's, and an endpoint
receives them only when it lists them in `event_types`.
"""

from __future__ import annotations

import json
from typing import Any

from app.core.db import storable_json

JOB_SUCCEEDED = "fine_tuning.job.succeeded"
JOB_FAILED = "fine_tuning.job.failed"
JOB_CANCELLED = "fine_tuning.job.cancelled"
JOB_PAUSED = "x_agent_rft.fine_tuning.job.paused"
CHECKPOINT_CREATED = "x_agent_rft.fine_tuning.job.checkpoint.created"

EVENT_TYPES: tuple[str, ...] = (JOB_SUCCEEDED, JOB_FAILED, JOB_CANCELLED, JOB_PAUSED, CHECKPOINT_CREATED)

# The job status whose arrival emits an event (app/jobs/state.py::transition calls the outbox).
EVENT_FOR_STATUS: dict[str, str] = {
    "succeeded": JOB_SUCCEEDED, "failed": JOB_FAILED, "cancelled": JOB_CANCELLED, "paused": JOB_PAUSED,
}


def event_body(event_id: str, event_type: str, created_at: int, data: dict[str, Any]) -> str:
    """`{"id": "evt_…", "object": "event", "created_at", "type", "data"}` as compact JSON: the
    exact bytes that are signed and sent on every attempt (NaN, which is not JSON, becomes null)."""
    body = {"id": event_id, "object": "event", "created_at": created_at, "type": event_type, "data": storable_json(data)}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
