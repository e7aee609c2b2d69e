"""Webhook deliveries across worker restarts and real training, each test with its own API
server and Celery worker subprocesses: a worker killed mid-delivery, and the events of a job that
really trains the tiny model (succeeded, checkpoints)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import openai
import pytest

from app.core.config import Settings
from tests.conftest import live_server, wait_for
from tests.rl.tool_server import tool_server
from tests.test_training_e2e import create_job
from tests.webhook_helpers import (
    CHECKPOINT,
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


@pytest.fixture
def wh_settings(settings: Settings, tmp_path: Path, redis_client):
    yield webhook_settings(settings, tmp_path)
    redis_client.delete(settings.webhook_queue)


def test_a_worker_killed_mid_delivery_delivers_after_restart(wh_settings, project):
    with live_server(wh_settings) as base, receiver(block_first=True) as recv, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        endpoint_id = endpoint_for(sdk, recv, STANDARD)
        with celery_worker(wh_settings, base, wh_settings.webhook_queue) as (worker, _):
            # The worker dies without a word the moment its request arrives (which stays open).
            recv.on_first_request = lambda: os.killpg(worker.pid, signal.SIGKILL)
            sdk.fine_tuning.jobs.cancel(queued_job(sdk))
            assert recv.got_request.wait(timeout=60)
            worker.wait(timeout=30)
        delivery, = deliveries(sdk, endpoint_id)
        assert delivery["status"] == "pending"
        assert [a["outcome"] for a in attempts(sdk, endpoint_id, delivery["id"])] == ["in_flight"]
        with celery_worker(wh_settings, base, wh_settings.webhook_queue):
            delivered, = settled(sdk, endpoint_id, 1)
        assert delivered["status"] == "delivered"
        assert len(recv.requests) == 2 and {r.webhook_id for r in recv.requests} == {delivery["id"]}
        assert all(r.verified for r in recv.requests)
        log = attempts(sdk, endpoint_id, delivery["id"])
        assert [(a["attempt_number"], a["outcome"]) for a in log] == [(2, "delivered"), (1, "lost")]
        assert "stopped before reporting" in log[1]["error"]


def test_a_trained_job_sends_succeeded_and_its_checkpoints(wh_settings, project):
    """A real job trains the tiny model on a worker that serves the training and webhook queues."""
    queues = f"{wh_settings.training_queue},{wh_settings.webhook_queue}"
    with live_server(wh_settings) as base, tool_server() as (tool_url, _), receiver() as recv, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(wh_settings, base, queues) as (_, log):
        endpoint_id = endpoint_for(sdk, recv, ["fine_tuning.job.succeeded", CHECKPOINT])
        job_id = create_job(sdk, tool_url, n_rows=2)
        wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status in ("succeeded", "failed"), timeout=240,
                 interval=0.5)
        assert sdk.fine_tuning.jobs.retrieve(job_id).status == "succeeded", log.read_text()[-3000:]
        checkpoints = {c.id: c for c in sdk.fine_tuning.jobs.checkpoints.list(job_id)}
        assert {d["status"] for d in settled(sdk, endpoint_id, 1 + len(checkpoints))} == {"delivered"}
        assert all(r.verified for r in recv.requests)
        succeeded, = recv.of_type("fine_tuning.job.succeeded")
        assert isinstance(succeeded.event, openai.types.webhooks.FineTuningJobSucceededWebhookEvent)
        assert succeeded.event.data.id == job_id
        sent = [json.loads(r.body)["data"] for r in recv.of_type(CHECKPOINT)]
        assert {d["checkpoint_id"] for d in sent} == set(checkpoints) and {d["id"] for d in sent} == {job_id}
        for data in sent:
            checkpoint = checkpoints[data["checkpoint_id"]]
            assert data["step_number"] == checkpoint.step_number
            assert data["fine_tuned_model_checkpoint"] == checkpoint.fine_tuned_model_checkpoint
