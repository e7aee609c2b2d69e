"""Shapes of /v1/webhook_endpoints as the `openai` SDK's `client.webhooks` sends and parses them
(openai.types.webhooks), plus this service's extensions: `status` and `disabled_reason` on the
endpoint, the deliveries and their attempt log, and the internal claim/report calls."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent_rft.urls import check_http_url
from app.webhooks.events import EVENT_TYPES
from app.webhooks.models import DeliveryState


def _known_event_type(value: str) -> str:
    if value not in EVENT_TYPES:
        raise ValueError(f"'{value}' is not an event type this service sends; GET /v1/webhook_event_types lists them: "
                         + ", ".join(EVENT_TYPES))
    return value


def _event_types(values: list[str]) -> list[str]:
    if not values:
        raise ValueError("must list at least one event type")
    return list(dict.fromkeys(_known_event_type(v) for v in values))


def _url(value: str) -> str:
    return check_http_url(value.strip())


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    url: str = Field(min_length=1, max_length=2048)
    event_types: list[str]

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return _url(value)

    @field_validator("event_types")
    @classmethod
    def _check_types(cls, value: list[str]) -> list[str]:
        return _event_types(value)


class EndpointUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=256)
    url: str | None = Field(None, min_length=1, max_length=2048)
    event_types: list[str] | None = None
    # Extension: "enabled" re-enables an endpoint that was disabled (after 410 Gone or persistent failure).
    status: Literal["enabled", "disabled"] | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        return None if value is None else _url(value)

    @field_validator("event_types")
    @classmethod
    def _check_types(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else _event_types(value)


class RotateSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


class EndpointTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_type: str

    @field_validator("event_type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        return _known_event_type(value)


class EndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str
    created_at: int
    updated_at: int
    status: Literal["enabled", "disabled"] = Field(
        description="Extension: 'disabled' after 410 Gone, persistent failure, or the owner's update.")
    disabled_reason: str | None = Field(None, description="Extension: why the endpoint was disabled.")
    disabled_at: int | None = None


class EndpointWithSecret(EndpointObject):
    signing_secret: str = Field(description="Returned only at creation and rotation.")


class DeletedEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class EndpointTestResult(BaseModel):
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: bool  # as a real delivery counts it: a 2xx answer
    latency_ms: int | None = None
    error: str | None = None  # why it does not count as delivered


class EventTypeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[str]




class DeliveryObject(BaseModel):
    """Extension: one event to one endpoint; `id` is the `webhook-id` header of every attempt."""

    id: str
    object: Literal["webhook_endpoint.delivery"] = "webhook_endpoint.delivery"
    webhook_endpoint_id: str
    event_id: str
    event_type: str
    status: DeliveryState
    attempt_count: int
    created_at: int
    next_attempt_at: int | None
    delivered_at: int | None
    last_status_code: int | None
    last_error: str | None
    event: dict[str, Any] = Field(description="The event body, as sent.")


class AttemptObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint.delivery_attempt"] = "webhook_endpoint.delivery_attempt"
    delivery_id: str
    attempt_number: int
    outcome: Literal["in_flight", "delivered", "failed", "lost"]
    created_at: int = Field(description="When the attempt started.")
    status_code: int | None
    latency_ms: int | None
    response_excerpt: str | None = Field(description="The first KiB of the endpoint's answer.")
    error: str | None
    worker_id: str | None


# --- internal: the worker's side ----------------------------------------------------------

class DeliveryClaimRequest(BaseModel):
    worker_id: str = Field(min_length=1, max_length=255)


class DeliveryClaim(BaseModel):
    """Everything a worker needs for one attempt, signed by the control plane: workers never see
    signing secrets."""

    delivery_id: str
    claim_id: str
    attempt_number: int
    url: str
    headers: dict[str, str]
    body: str
    timeout_s: float


class DeliveryClaimResponse(BaseModel):
    """`send` with the attempt to make, or `skip` with the reason there is nothing to send now."""

    action: Literal["send", "skip"]
    reason: str | None = None
    attempt: DeliveryClaim | None = None


class AttemptReport(BaseModel):
    claim_id: str = Field(min_length=1, max_length=64)
    status_code: int | None = Field(None, ge=100, le=599)
    latency_ms: int | None = Field(None, ge=0)
    response_excerpt: str | None = Field(None, max_length=4096)
    error: str | None = Field(None, max_length=4096)


class AttemptReportResult(BaseModel):
    delivery_id: str
    status: DeliveryState
    next_attempt_at: int | None
