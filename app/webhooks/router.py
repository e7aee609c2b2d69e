"""`/v1/webhook_endpoints` and `/v1/webhook_event_types`, as the `openai` SDK's `client.webhooks`
calls them, plus this service's deliveries and attempt log. The workers' two calls are worker_router.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool

from app.core.deps import CurrentKey, SessionDep, SettingsDep, done_with_database
from app.core.pagination import ListPage
from app.webhooks import service
from app.webhooks.schemas import (
    AttemptObject,
    DeletedEndpoint,
    DeliveryObject,
    DeliveryState,
    EndpointCreate,
    EndpointObject,
    EndpointTest,
    EndpointTestResult,
    EndpointUpdate,
    EndpointWithSecret,
    EventTypeList,
    RotateSecret,
)

router = APIRouter(prefix="/v1", tags=["webhooks"])
Limit = Annotated[int, Query(ge=1, le=100)]


@router.post("/webhook_endpoints", response_model=EndpointWithSecret)
def create_endpoint(body: EndpointCreate, principal: CurrentKey, session: SessionDep,
                    settings: SettingsDep) -> EndpointWithSecret:
    """Create an endpoint; the answer carries its `signing_secret`, shown this once."""
    return service.create_endpoint(session=session, settings=settings, project_id=principal.project_id, body=body)


@router.get("/webhook_endpoints", response_model=ListPage[EndpointObject])
def list_endpoints(principal: CurrentKey, session: SessionDep, after: str | None = None,
                   limit: Limit = 20) -> ListPage[EndpointObject]:
    """The project's endpoints, newest first."""
    return service.list_endpoints(session=session, project_id=principal.project_id, after=after, limit=limit)


@router.get("/webhook_endpoints/{webhook_endpoint_id}", response_model=EndpointObject)
def retrieve_endpoint(webhook_endpoint_id: str, principal: CurrentKey, session: SessionDep) -> EndpointObject:
    return service.get_endpoint(session=session, project_id=principal.project_id, endpoint_id=webhook_endpoint_id)


@router.post("/webhook_endpoints/{webhook_endpoint_id}", response_model=EndpointObject)
def update_endpoint(webhook_endpoint_id: str, body: EndpointUpdate, principal: CurrentKey, session: SessionDep,
                    settings: SettingsDep) -> EndpointObject:
    """Change `name`, `url`, `event_types`, or (extension) `status` to re-enable a disabled endpoint."""
    return service.update_endpoint(session=session, settings=settings, project_id=principal.project_id,
                                   endpoint_id=webhook_endpoint_id, body=body)


@router.delete("/webhook_endpoints/{webhook_endpoint_id}", response_model=DeletedEndpoint)
def delete_endpoint(webhook_endpoint_id: str, principal: CurrentKey, session: SessionDep) -> DeletedEndpoint:
    return service.delete_endpoint(session=session, project_id=principal.project_id, endpoint_id=webhook_endpoint_id)


@router.post("/webhook_endpoints/{webhook_endpoint_id}/rotate_secret", response_model=EndpointWithSecret)
def rotate_secret(webhook_endpoint_id: str, principal: CurrentKey, session: SessionDep, settings: SettingsDep,
                  body: RotateSecret | None = None) -> EndpointWithSecret:
    """A new signing secret, shown this once; with `keep_old_secret_active_for_24_hours` deliveries
    are signed with both secrets for 24 hours."""
    return service.rotate_secret(session=session, settings=settings, project_id=principal.project_id,
                                 endpoint_id=webhook_endpoint_id, body=body or RotateSecret())


@router.post("/webhook_endpoints/{webhook_endpoint_id}/test", response_model=EndpointTestResult)
async def test_endpoint(webhook_endpoint_id: str, body: EndpointTest, request: Request, principal: CurrentKey,
                        session: SessionDep, settings: SettingsDep) -> EndpointTestResult:
    """Send a signed sample event of `event_type` now; the answer has the endpoint's status code."""
    test = await run_in_threadpool(service.prepare_test, session=session, settings=settings,
                                   project_id=principal.project_id, endpoint_id=webhook_endpoint_id, body=body)
    await done_with_database(request)  # the receiver may take up to the webhook timeout
    return await service.send_test(test, settings=settings)


@router.get("/webhook_event_types", response_model=EventTypeList)
def list_event_types(principal: CurrentKey) -> EventTypeList:
    """Every event type this service sends (its own carry the `x_agent_rft.` prefix)."""
    return service.event_types()


@router.get("/webhook_endpoints/{webhook_endpoint_id}/deliveries", response_model=ListPage[DeliveryObject])
def list_deliveries(webhook_endpoint_id: str, principal: CurrentKey, session: SessionDep,
                    status: DeliveryState | None = None, after: str | None = None,
                    limit: Limit = 20) -> ListPage[DeliveryObject]:
    """Extension: the endpoint's deliveries, newest first; `status` filters."""
    return service.list_deliveries(session=session, project_id=principal.project_id, endpoint_id=webhook_endpoint_id,
                                   status=status, after=after, limit=limit)


@router.get("/webhook_endpoints/{webhook_endpoint_id}/deliveries/{delivery_id}", response_model=DeliveryObject)
def retrieve_delivery(webhook_endpoint_id: str, delivery_id: str, principal: CurrentKey,
                      session: SessionDep) -> DeliveryObject:
    return service.get_delivery(session=session, project_id=principal.project_id, endpoint_id=webhook_endpoint_id,
                                delivery_id=delivery_id)


@router.get("/webhook_endpoints/{webhook_endpoint_id}/deliveries/{delivery_id}/attempts",
            response_model=ListPage[AttemptObject])
def list_attempts(webhook_endpoint_id: str, delivery_id: str, principal: CurrentKey, session: SessionDep,
                  after: str | None = None, limit: Limit = 20) -> ListPage[AttemptObject]:
    """Extension: the delivery's attempt log, newest first."""
    return service.list_attempts(session=session, project_id=principal.project_id, endpoint_id=webhook_endpoint_id,
                                 delivery_id=delivery_id, after=after, limit=limit)


@router.post("/webhook_endpoints/{webhook_endpoint_id}/deliveries/{delivery_id}/redeliver",
             response_model=DeliveryObject)
def redeliver(webhook_endpoint_id: str, delivery_id: str, principal: CurrentKey, session: SessionDep) -> DeliveryObject:
    """Extension: send the delivery again now, same `webhook-id`, with a fresh retry schedule."""
    return service.redeliver(session=session, project_id=principal.project_id, endpoint_id=webhook_endpoint_id,
                             delivery_id=delivery_id)
