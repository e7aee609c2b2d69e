"""Hand-off to workers: a validated job's task lands on the real Redis queue."""

import base64
import json

from app.core.config import Settings
from app.jobs import pipeline
from app.main import create_app
from tests.conftest import job_body, question_rows, wait_for


def queued_job_ids(redis_client, queue: str) -> list[str]:
    """Decode Celery's messages on the Redis list, oldest first."""
    ids = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        assert message["headers"]["task"] == "agent_rft.run_job"
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        ids.append(args[0])
    return ids


def test_validated_job_reaches_the_redis_queue(api, settings, redis_client):
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    wait_for(lambda: queued_job_ids(redis_client, settings.training_queue))
    assert queued_job_ids(redis_client, settings.training_queue) == [job_id]
    events = api.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]
    assert events[0]["message"] == "Job sent to the training queue."
    assert events[0]["data"]["task_id"].startswith(job_id)


def test_resume_enqueues_again(api, settings, redis_client):
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    wait_for(lambda: queued_job_ids(redis_client, settings.training_queue))
    api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
    api.post(f"/v1/fine_tuning/jobs/{job_id}/resume")
    wait_for(lambda: len(queued_job_ids(redis_client, settings.training_queue)) == 2)
    assert queued_job_ids(redis_client, settings.training_queue) == [job_id, job_id]


def test_failed_validation_enqueues_nothing(api, settings, redis_client):
    file_id = api.upload_ok(b"{broken\n")
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "failed")
    assert redis_client.llen(settings.training_queue) == 0


def test_broker_outage_loses_no_job(api, app, settings, redis_client, pg_url, tmp_path):
    """With the broker down the job stays queued and says so; the next start-up sends it."""
    dead = Settings(_env_file=None, data_dir=tmp_path / "d", database_url=pg_url, broker_url="redis://127.0.0.1:1/0",
                    training_queue=settings.training_queue, outbound_allowlist=["127.0.0.1"])
    from app.core.queue import JobQueue

    app.state.queue = JobQueue(dead)
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "queued"
    warning = api.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"][0]
    assert warning["level"] == "warn" and "broker" in warning["message"]
    assert redis_client.llen(settings.training_queue) == 0

    # A restarted server (same database, broker back) finishes the hand-off.
    from fastapi.testclient import TestClient

    with TestClient(create_app(settings)):
        wait_for(lambda: queued_job_ids(redis_client, settings.training_queue) == [job_id])


def test_startup_finishes_interrupted_validation(api, app, settings, redis_client, project):
    """A job left in validating_files by a crash is validated when the server starts again."""
    file_id = api.upload_ok(question_rows())
    # Create the job without running its background validation, as if the process died right after.
    from app.core.db import make_engine, make_session_factory
    from app.jobs.schemas import JobCreate
    from app.jobs.service import create_job

    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        job, _ = create_job(session=session, settings=settings, project_id=project["project_id"],
                            body=JobCreate(**job_body(file_id)), idempotency_key=None)
    engine.dispose()
    assert api.get(f"/v1/fine_tuning/jobs/{job.id}").json()["status"] == "validating_files"
    pipeline.recover(app.state.session_factory, app.state.storage, app.state.queue, min_rows=1)
    assert api.get(f"/v1/fine_tuning/jobs/{job.id}").json()["status"] == "queued"
    assert queued_job_ids(redis_client, settings.training_queue) == [job.id]

