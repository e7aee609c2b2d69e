"""Webhook endpoints through the `openai` SDK's `client.webhooks`, the SSRF guard on their URLs,
and the outbox: events written in the job's own transaction and handed to the real Redis queue
after the commit, or by the sweeper when that hand-off never happened.
Deliveries by a real worker: tests/test_webhooks_delivery.py."""

from __future__ import annotations

import base64
import json
import uuid

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.core.db import make_engine, make_session_factory
from app.jobs.models import Job
from app.jobs.state import JobStatus, transition
from app.main import create_app
from app.webhooks.events import EVENT_TYPES
from app.webhooks.models import WebhookDelivery, WebhookEvent
from tests.conftest import Api, job_body, live_server, make_project, question_rows, wait_for
from tests.webhook_helpers import receiver

STANDARD = ["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]
PAUSED = "x_agent_rft.fine_tuning.job.paused"


@pytest.fixture
def wh_settings(settings, redis_client):
    settings.webhook_queue = f"test-webhooks-{uuid.uuid4().hex[:8]}"
    settings.webhook_sweep_interval_s = 0.2
    yield settings
    redis_client.delete(settings.webhook_queue)


@pytest.fixture
def sdk(wh_settings, project):
    with live_server(wh_settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as client:
        yield client


def queued_deliveries(redis_client, queue: str) -> list[str]:
    ids = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        assert message["headers"]["task"] == "agent_rft.deliver_webhook"
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        ids.append(args[0])
    return ids


def test_endpoints_through_the_sdk(sdk, wh_settings):
    created = sdk.webhooks.create(name="ops", url="https://example.com/hooks", event_types=STANDARD)
    assert created.object == "webhook_endpoint" and created.id.startswith("we_")
    assert created.signing_secret.startswith("whsec_") and len(base64.b64decode(created.signing_secret[6:])) == 24
    assert created.signing_secret_hint == f"whsec_****{created.signing_secret[-4:]}"
    assert created.event_types == STANDARD and created.updated_at == created.created_at

    fetched = sdk.get(f"/webhook_endpoints/{created.id}", cast_to=object)
    assert "signing_secret" not in fetched and fetched["signing_secret_hint"] == created.signing_secret_hint
    assert fetched["status"] == "enabled" and fetched["disabled_reason"] is None
    assert sdk.webhooks.retrieve(created.id).url == "https://example.com/hooks"

    updated = sdk.webhooks.update(created.id, name="ops-2", event_types=["fine_tuning.job.failed", PAUSED])
    assert (updated.name, updated.event_types, updated.url) == ("ops-2", ["fine_tuning.job.failed", PAUSED],
                                                                 "https://example.com/hooks")
    others = [sdk.webhooks.create(name=f"e{i}", url=f"https://example.com/{i}", event_types=STANDARD[:1]).id
              for i in range(2)]
    page = sdk.webhooks.list(limit=2)
    assert [e.id for e in page.data] == others[::-1] and page.has_more
    assert [e.id for e in sdk.webhooks.list(limit=2)] == [*others[::-1], created.id]  # the SDK follows `after`

    assert sdk.webhooks.event_types.list().data == list(EVENT_TYPES)
    assert sdk.webhooks.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.webhooks.retrieve(created.id)


def test_bad_endpoint_requests_name_the_field(sdk):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.webhooks.create(name="x", url="https://example.com/h", event_types=["batch.completed"])
    error = refused.value.body
    assert error["param"] == "event_types" and "/v1/webhook_event_types" in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.webhooks.create(name="x", url="ftp://example.com/h", event_types=STANDARD)
    assert refused.value.body["param"] == "url"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.webhooks.create(name="x", url="https://user:pw@example.com/h", event_types=STANDARD)
    assert "credentials" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        sdk.webhooks.create(name="x", url="https://example.com/h", event_types=[])


def test_another_projects_endpoint_is_not_found(sdk, wh_settings):
    created = sdk.webhooks.create(name="mine", url="https://example.com/h", event_types=STANDARD)
    other = make_project(wh_settings)
    stranger = sdk.with_options(api_key=other["key"])
    for call in (lambda: stranger.webhooks.retrieve(created.id), lambda: stranger.webhooks.delete(created.id),
                 lambda: stranger.webhooks.update(created.id, name="theirs"),
                 lambda: stranger.webhooks.rotate_secret(created.id),
                 lambda: stranger.get(f"/webhook_endpoints/{created.id}/deliveries", cast_to=object)):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "webhook_endpoint_not_found"
    assert list(stranger.webhooks.list()) == []


@pytest.mark.parametrize("status", [302, 404, 500])
def test_a_test_answered_outside_2xx_is_no_success_and_says_why(sdk, status):
    """A real delivery counts only a 2xx as delivered; the test send says the same, not success."""
    with receiver(statuses=[status]) as recv:
        created = sdk.webhooks.create(name="t", url=recv.url, event_types=STANDARD)
        recv.secret = created.signing_secret
        result = sdk.webhooks.test(created.id, event_type="fine_tuning.job.succeeded")
        assert recv.requests[-1].verified
    assert (result.status_code, result.success) == (status, False)
    assert f"HTTP {status}" in result.model_extra["error"] and "2xx" in result.model_extra["error"]


def test_test_sends_a_signed_sample_and_rotation_keeps_the_old_secret_on_request(sdk):
    with receiver(statuses=[202]) as recv:
        created = sdk.webhooks.create(name="t", url=recv.url, event_types=STANDARD)
        recv.secret = created.signing_secret
        result = sdk.webhooks.test(created.id, event_type="fine_tuning.job.succeeded")
        assert (result.object, result.status_code, result.success, result.webhook_endpoint_id) == \
            ("webhook_endpoint.test", 202, True, created.id)
        sample = recv.requests[-1]
        assert sample.verified and sample.event.type == "fine_tuning.job.succeeded"
        assert sample.event.id.startswith("evt_") and sample.event.object == "event"

        rotated = sdk.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
        assert rotated.signing_secret != created.signing_secret
        assert rotated.signing_secret_hint == f"whsec_****{rotated.signing_secret[-4:]}"
        assert sdk.webhooks.test(created.id, event_type="fine_tuning.job.failed").status_code == 200
        both = recv.requests[-1]
        assert len(both.headers["webhook-signature"].split()) == 2
        for secret in (created.signing_secret, rotated.signing_secret):
            assert recv.verify(both.body, both.headers, secret).type == "fine_tuning.job.failed"

        again = sdk.webhooks.rotate_secret(created.id)  # the old secret stops at once
        recv.secret = again.signing_secret
        assert sdk.webhooks.test(created.id, event_type="fine_tuning.job.cancelled").status_code == 200
        last = recv.requests[-1]
        assert last.verified and len(last.headers["webhook-signature"].split()) == 1
        with pytest.raises(openai.InvalidWebhookSignatureError):
            recv.verify(last.body, last.headers, rotated.signing_secret)

        recv.secret = "whsec_" + base64.b64encode(b"x" * 24).decode()  # a receiver with the wrong secret says 400
        assert sdk.webhooks.test(created.id, event_type="fine_tuning.job.cancelled").status_code == 400
    with pytest.raises(openai.BadRequestError) as unreachable:  # the server is gone now
        sdk.webhooks.test(created.id, event_type="fine_tuning.job.cancelled")
    assert unreachable.value.body["code"] == "webhook_endpoint_unreachable"


def test_ssrf_guard_refuses_private_urls_unless_allow_listed(client, app, project):
    app.state.settings.outbound_allowlist = []
    api = Api(client, project["key"])
    for url in ("http://127.0.0.1:8080/hook", "http://localhost/hook", "http://169.254.169.254/latest/meta-data",
                "http://10.1.2.3/", "http://[::1]:80/"):
        response = api.post("/v1/webhook_endpoints", json={"name": "x", "url": url, "event_types": STANDARD})
        assert response.status_code == 400, url
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("url_not_allowed", "url")
        assert "AGENT_RFT_OUTBOUND_ALLOWLIST" in error["message"] and "non-public address" in error["message"]
    endpoint_id = _endpoint(api, STANDARD)
    moved = api.post(f"/v1/webhook_endpoints/{endpoint_id}", json={"url": "http://127.0.0.1:8080/hook"})
    assert moved.status_code == 400 and moved.json()["error"]["code"] == "url_not_allowed"

    app.state.settings.outbound_allowlist = ["127.0.0.1"]
    allowed = api.post("/v1/webhook_endpoints", json={"name": "x", "url": "http://127.0.0.1:8080/hook",
                                                      "event_types": STANDARD})
    assert allowed.status_code == 200 and allowed.json()["url"] == "http://127.0.0.1:8080/hook"


def _job(api: Api) -> str:
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued")
    return job_id


def _endpoint(api: Api, event_types: list[str], url: str = "https://example.com/h") -> str:
    response = api.post("/v1/webhook_endpoints", json={"name": "e", "url": url, "event_types": event_types})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_job_events_are_written_with_the_status_and_queued_after_the_commit(api, wh_settings, redis_client):
    standard = _endpoint(api, STANDARD)
    with_paused = _endpoint(api, ["fine_tuning.job.cancelled", PAUSED])
    job_id = _job(api)

    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").status_code == 200
    assert api.get(f"/v1/webhook_endpoints/{standard}/deliveries").json()["data"] == []  # not subscribed
    paused = api.get(f"/v1/webhook_endpoints/{with_paused}/deliveries").json()["data"]
    assert [d["event_type"] for d in paused] == [PAUSED] and paused[0]["status"] == "pending"

    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    cancelled = api.get(f"/v1/webhook_endpoints/{standard}/deliveries").json()["data"]
    assert [d["event_type"] for d in cancelled] == ["fine_tuning.job.cancelled"]
    event = cancelled[0]["event"]
    assert event["object"] == "event" and event["id"].startswith("evt_") and event["data"] == {"id": job_id}
    assert event["type"] == "fine_tuning.job.cancelled" and isinstance(event["created_at"], int)
    assert cancelled[0]["id"].startswith("wh_") and cancelled[0]["attempt_count"] == 0
    both = api.get(f"/v1/webhook_endpoints/{with_paused}/deliveries").json()["data"]
    assert both[0]["event_id"] == cancelled[0]["event_id"]  # one event, one delivery per endpoint

    # Handed to the broker right after each commit: the real Redis queue holds a task per delivery
    # (a second one for the same delivery is possible when the sweeper runs in between: harmless).
    expected = [paused[0]["id"], *sorted([cancelled[0]["id"], both[0]["id"]])]
    wait_for(lambda: len(set(queued_deliveries(redis_client, wh_settings.webhook_queue))) >= 3)
    sent = list(dict.fromkeys(queued_deliveries(redis_client, wh_settings.webhook_queue)))
    assert [sent[0], *sorted(sent[1:])] == expected


def test_a_rolled_back_status_change_leaves_no_event(api, wh_settings, app):
    _endpoint(api, STANDARD)
    job_id = _job(api)
    factory = app.state.session_factory
    with factory() as session:
        job = session.scalar(select(Job).where(Job.id == job_id).with_for_update())
        transition(session, job, JobStatus.CANCELLED, message="cancelled, then rolled back")
        session.flush()
        assert session.scalar(select(func.count()).select_from(WebhookDelivery)) == 1
        session.rollback()
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(WebhookEvent)) == 0
        assert session.scalar(select(Job.status).where(Job.id == job_id)) == "queued"


def test_a_delivery_committed_but_never_handed_over_is_sent_at_start_up(wh_settings, project, redis_client):
    """As if the API died between the commit and the hand-off: the rows exist, the queue is empty;
    the next process's sweeper sends it."""
    with TestClient(create_app(wh_settings)) as client:
        api = Api(client, project["key"])
        endpoint_id = _endpoint(api, STANDARD)
        job_id = _job(api)
    engine = make_engine(wh_settings.resolved_database_url)
    try:
        with make_session_factory(engine).begin() as session:  # a factory without the after-commit hand-off
            job = session.scalar(select(Job).where(Job.id == job_id).with_for_update())
            transition(session, job, JobStatus.CANCELLED, message="cancelled by a process that then died")
    finally:
        engine.dispose()
    assert queued_deliveries(redis_client, wh_settings.webhook_queue) == []
    with TestClient(create_app(wh_settings)) as client:
        delivery_id = Api(client, project["key"]).get(
            f"/v1/webhook_endpoints/{endpoint_id}/deliveries").json()["data"][0]["id"]
        wait_for(lambda: queued_deliveries(redis_client, wh_settings.webhook_queue))
    assert set(queued_deliveries(redis_client, wh_settings.webhook_queue)) == {delivery_id}


@pytest.mark.sqlite
def test_embedded_default_writes_and_queues_deliveries(tmp_path, monkeypatch):
    import sqlite3

    from app.core.config import Settings
    from app.core.migrations import upgrade

    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings(_env_file=None, data_dir=tmp_path, outbound_allowlist=["127.0.0.1"])
    upgrade(settings.resolved_database_url)
    project = make_project(settings)
    with TestClient(create_app(settings)) as client:
        api = Api(client, project["key"])
        endpoint_id = _endpoint(api, ["fine_tuning.job.cancelled", PAUSED])
        job_id = _job(api)
        api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
        api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        sent = api.get(f"/v1/webhook_endpoints/{endpoint_id}/deliveries").json()["data"]
    assert [d["event_type"] for d in sent] == ["fine_tuning.job.cancelled", PAUSED]
    with sqlite3.connect(tmp_path / "broker.sqlite3") as broker:
        payloads = [row[0] for row in broker.execute("SELECT payload FROM kombu_message")]
    assert all(any(d["id"] in p for p in payloads) for d in sent)


def test_an_attempt_has_a_time_limit_follows_no_redirect_and_is_ssrf_checked():
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, RedirectResponse
    from starlette.routing import Route

    from app.webhooks.sender import send_attempt
    from tests.conftest import serve_app

    async def slow(_request):  # noqa: ANN001, ANN202
        await asyncio.sleep(5)
        return PlainTextResponse("late")

    async def moved(_request):  # noqa: ANN001, ANN202
        return RedirectResponse("https://elsewhere.example.com/hook", status_code=307)

    app = Starlette(routes=[Route("/slow", slow, methods=["POST"]), Route("/moved", moved, methods=["POST"])])
    with serve_app(app) as port:
        def attempt(path: str, allowlist: list[str]):  # noqa: ANN202
            return asyncio.run(send_attempt(f"http://127.0.0.1:{port}{path}", {"webhook-id": "wh_x"}, "{}",
                                            allowlist=allowlist, timeout_s=0.5))

        late = attempt("/slow", ["127.0.0.1"])
        assert late.status_code is None and late.error == "timed out after 0.5 s" and late.latency_ms >= 500
        redirected = attempt("/moved", ["127.0.0.1"])
        assert redirected.status_code == 307 and not redirected.succeeded
        assert "https://elsewhere.example.com/hook" in redirected.error and "not followed" in redirected.error
        blocked = attempt("/moved", [])
        assert blocked.status_code is None and "SSRF guard" in blocked.error


def test_the_default_retry_schedule_spans_more_than_a_day_with_jitter():
    from app.core.config import Settings
    from app.webhooks.service import retry_delay

    settings = Settings(_env_file=None)
    schedule = settings.webhook_retry_schedule_s
    assert sum(schedule) > 24 * 3600 and schedule == sorted(schedule)
    delays = [retry_delay(settings, 2) for _ in range(200)]
    assert all(0.8 * 300 <= d <= 1.2 * 300 for d in delays) and len(set(delays)) > 100
    assert retry_delay(settings, len(schedule)) is not None and retry_delay(settings, len(schedule) + 1) is None
