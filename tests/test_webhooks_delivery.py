"""Webhook deliveries end to end: the API writes the events of real jobs, a real Celery worker
(a subprocess on Redis, no database credentials) delivers them to a receiver on 127.0.0.1 that
verifies every request with the `openai` SDK's `client.webhooks.unwrap`.

The tests here share one API server and one webhook worker (starting a worker takes seconds);
each has its own project and receiver, and the tables are emptied after it. Tests that start
and kill their own workers: tests/test_webhooks_worker.py."""

from __future__ import annotations

import uuid

import openai
import pytest
import redis

from app.core.config import Settings
from tests.conftest import REDIS_URL, _truncate_all, live_server, make_project, wait_for
from tests.webhook_helpers import (
    PAUSED,
    STANDARD,
    attempts,
    celery_worker,
    deliveries,
    endpoint_for,
    queued_job,
    receiver,
    settled,
    webhook_settings,
)


@pytest.fixture(scope="module")
def shared_stack(pg_url: str, tmp_path_factory):  # noqa: ANN001, ANN201
    """One API server and one worker on its webhook queue, for the tests of this module."""
    tmp = tmp_path_factory.mktemp("webhooks")
    settings = webhook_settings(Settings(
        _env_file=None, data_dir=tmp / "data", database_url=pg_url, broker_url=REDIS_URL,
        training_queue=f"test-training-{uuid.uuid4().hex[:8]}", outbound_allowlist=["127.0.0.1"]), tmp)
    with live_server(settings) as base, celery_worker(settings, base, settings.webhook_queue):
        yield settings, base
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(settings.webhook_queue, settings.training_queue)
    client.close()


@pytest.fixture
def sdk(shared_stack):  # noqa: ANN001, ANN201
    """An SDK client of a new project on the shared stack; the tables are emptied afterwards."""
    settings, base = shared_stack
    project = make_project(settings)
    try:
        with openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as client:
            yield client
    finally:
        _truncate_all(settings.database_url)


def test_cancelled_failed_and_paused_jobs_reach_subscribed_receivers(sdk):
    with receiver() as plain, receiver() as extended:
        plain_id = endpoint_for(sdk, plain, STANDARD)
        extended_id = endpoint_for(sdk, extended, ["fine_tuning.job.failed", "fine_tuning.job.cancelled", PAUSED])

        failing = queued_job(sdk, rows=[{"messages": "not a list"}])  # file validation fails the job
        paused_then_cancelled = queued_job(sdk)
        sdk.fine_tuning.jobs.pause(paused_then_cancelled)
        sdk.fine_tuning.jobs.cancel(paused_then_cancelled)

        assert {d["status"] for d in settled(sdk, plain_id, 2)} == {"delivered"}
        assert {d["status"] for d in settled(sdk, extended_id, 3)} == {"delivered"}
        assert all(r.verified for r in plain.requests + extended.requests)
        failed, = plain.of_type("fine_tuning.job.failed")
        assert isinstance(failed.event, openai.types.webhooks.FineTuningJobFailedWebhookEvent)
        assert failed.event.data.id == failing and failed.event.object == "event"
        assert failed.event.id.startswith("evt_") and failed.webhook_id.startswith("wh_")
        cancelled, = plain.of_type("fine_tuning.job.cancelled")
        assert isinstance(cancelled.event, openai.types.webhooks.FineTuningJobCancelledWebhookEvent)
        assert cancelled.event.data.id == paused_then_cancelled
        assert plain.of_type(PAUSED) == []  # not subscribed: never sent
        paused, = extended.of_type(PAUSED)
        assert paused.event.data.id == paused_then_cancelled
        # One event, one delivery (and webhook-id) per endpoint.
        assert extended.of_type("fine_tuning.job.cancelled")[0].event.id == cancelled.event.id
        assert extended.of_type("fine_tuning.job.cancelled")[0].webhook_id != cancelled.webhook_id

        log = attempts(sdk, plain_id, cancelled.webhook_id)
        assert [(a["attempt_number"], a["outcome"], a["status_code"]) for a in log] == [(1, "delivered", 200)]
        assert log[0]["latency_ms"] >= 0 and log[0]["response_excerpt"] == "answered 200" and log[0]["error"] is None


def test_a_receiver_failing_twice_gets_the_same_event_again_then_a_manual_redelivery(sdk):
    with receiver(statuses=[500, 503]) as recv:
        endpoint_id = endpoint_for(sdk, recv, STANDARD)
        job_id = queued_job(sdk)
        sdk.fine_tuning.jobs.cancel(job_id)
        delivery, = settled(sdk, endpoint_id, 1)
        assert delivery["status"] == "delivered" and delivery["attempt_count"] == 3
        assert len(recv.requests) == 3 and all(r.verified for r in recv.requests)
        assert {r.webhook_id for r in recv.requests} == {delivery["id"]}
        assert {r.body for r in recv.requests} == {recv.requests[0].body}  # byte-identical body
        log = attempts(sdk, endpoint_id, delivery["id"])
        assert [(a["attempt_number"], a["outcome"], a["status_code"]) for a in log] == [
            (3, "delivered", 200), (2, "failed", 503), (1, "failed", 500)]
        assert log[2]["error"] == "the endpoint answered HTTP 500" and log[2]["response_excerpt"] == "answered 500"
        assert all(a["latency_ms"] is not None and a["created_at"] for a in log)

        again = sdk.post(f"/webhook_endpoints/{endpoint_id}/deliveries/{delivery['id']}/redeliver", cast_to=object)
        assert again["status"] == "pending"
        wait_for(lambda: len(recv.requests) == 4, timeout=30)
        assert recv.requests[-1].webhook_id == delivery["id"] and recv.requests[-1].verified
        wait_for(lambda: deliveries(sdk, endpoint_id)[0]["status"] == "delivered")
        assert len(attempts(sdk, endpoint_id, delivery["id"])) == 4


def test_rotation_signs_real_deliveries_with_both_secrets_during_the_window(sdk):
    with receiver() as recv:
        endpoint_id = endpoint_for(sdk, recv, STANDARD)
        first_secret = recv.secret
        kept = sdk.webhooks.rotate_secret(endpoint_id, keep_old_secret_active_for_24_hours=True)
        sdk.fine_tuning.jobs.cancel(queued_job(sdk))  # the receiver still verifies with the old secret
        settled(sdk, endpoint_id, 1)
        during = recv.requests[-1]
        assert during.verified and recv.verify(during.body, during.headers, kept.signing_secret)

        recv.secret = sdk.webhooks.rotate_secret(endpoint_id).signing_secret  # old secrets end now
        sdk.fine_tuning.jobs.cancel(queued_job(sdk))
        assert {d["status"] for d in settled(sdk, endpoint_id, 2)} == {"delivered"}
        after = recv.requests[-1]
        assert after.verified and after.webhook_id != during.webhook_id
        for old in (first_secret, kept.signing_secret):
            with pytest.raises(openai.InvalidWebhookSignatureError):
                recv.verify(after.body, after.headers, old)


def test_410_gone_disables_the_endpoint(sdk):
    with receiver(statuses=[410]) as recv:
        endpoint_id = endpoint_for(sdk, recv, STANDARD)
        sdk.fine_tuning.jobs.cancel(queued_job(sdk))
        delivery, = settled(sdk, endpoint_id, 1)
        assert delivery["status"] == "failed" and delivery["last_status_code"] == 410 and len(recv.requests) == 1
        endpoint = sdk.get(f"/webhook_endpoints/{endpoint_id}", cast_to=object)
        assert endpoint["status"] == "disabled" and "410 Gone" in endpoint["disabled_reason"]
        assert sdk.webhooks.retrieve(endpoint_id).model_extra["status"] == "disabled"

        sdk.fine_tuning.jobs.cancel(queued_job(sdk))  # a disabled endpoint gets no new deliveries
        assert len(deliveries(sdk, endpoint_id)) == 1
        with pytest.raises(openai.ConflictError):
            sdk.post(f"/webhook_endpoints/{endpoint_id}/deliveries/{delivery['id']}/redeliver", cast_to=object)
        enabled = sdk.webhooks.update(endpoint_id, extra_body={"status": "enabled"})
        assert enabled.model_extra["status"] == "enabled" and enabled.model_extra["disabled_reason"] is None
        sdk.post(f"/webhook_endpoints/{endpoint_id}/deliveries/{delivery['id']}/redeliver", cast_to=object)
        wait_for(lambda: deliveries(sdk, endpoint_id)[-1]["status"] == "delivered", timeout=30)


def test_persistent_failure_disables_the_endpoint(sdk):
    with receiver(statuses=[500] * 10) as recv:
        endpoint_id = endpoint_for(sdk, recv, STANDARD)
        sdk.fine_tuning.jobs.cancel(queued_job(sdk))
        delivery, = settled(sdk, endpoint_id, 1)
        assert delivery["status"] == "failed" and delivery["attempt_count"] == 3 and len(recv.requests) == 3
        assert delivery["last_error"].startswith("Gave up after 3 attempts")
        endpoint = sdk.get(f"/webhook_endpoints/{endpoint_id}", cast_to=object)
        assert endpoint["status"] == "disabled" and "Every attempt" in endpoint["disabled_reason"]
