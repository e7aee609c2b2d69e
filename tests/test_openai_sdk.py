"""The official `openai` SDK against a real uvicorn server, exactly as a user drives it.

The SDK builds its objects without validation; each response is also validated strictly
against the SDK's own types (`model_validate`), so a wrong field type fails here."""

import io

import openai
import pytest
from openai.types import FileDeleted, FileObject
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

from app.core.db import make_engine, make_session_factory
from app.jobs import service
from app.jobs.models import Job
from tests.conftest import jsonl, live_server, question_rows, wait_for


def strict(model_type, obj):  # noqa: ANN001, ANN201
    """Validate what the SDK parsed against its own pydantic type, strictly."""
    return model_type.model_validate(obj.model_dump(mode="json"), strict=False)


@pytest.fixture
def client(settings, project):  # noqa: ANN201
    with live_server(settings) as base_url:
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key=project["key"], max_retries=0) as sdk:
            yield sdk


def test_full_user_flow_with_the_openai_sdk(client, settings):
    uploaded = client.files.create(file=("train.jsonl", io.BytesIO(jsonl(question_rows(4)))), purpose="fine-tune")
    strict(FileObject, uploaded)
    assert uploaded.id.startswith("file-") and uploaded.purpose == "fine-tune" and uploaded.bytes > 0
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert client.files.retrieve(uploaded.id).filename == "train.jsonl"
    assert client.files.content(uploaded.id).read() == jsonl(question_rows(4))

    job = client.fine_tuning.jobs.create(
        model="SmolLM2-135M-Instruct",
        training_file=uploaded.id,
        seed=42,
        metadata={"experiment": "sdk"},
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                           "reference": "{{item.reference_answer}}", "operation": "eq"},
                "hyperparameters": {"batch_size": 2, "compute_multiplier": 1, "n_epochs": "auto"},
                "tools": [{"name": "search", "server_url": "http://127.0.0.1:8765/tools",
                           "headers": {"Authorization": "Bearer sdk-secret-token-999"}}],
                "max_episode_steps": 6,
                "x_open_model": {"lora_rank": 8},
            },
        },
    )
    strict(FineTuningJob, job)
    assert job.id.startswith("ftjob-") and job.status == "validating_files" and job.seed == 42
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.type == "string_check"
    assert job.method.reinforcement.hyperparameters.batch_size == 2
    assert "sdk-secret-token" not in job.model_dump_json()

    queued = wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status == "queued" and j)
    strict(FineTuningJob, queued)

    listed = client.fine_tuning.jobs.list(limit=10, metadata={"experiment": "sdk"})
    assert [j.id for j in listed] == [job.id]
    for j in listed.data:
        strict(FineTuningJob, j)
    assert list(client.fine_tuning.jobs.list(metadata={"experiment": "other"})) == []

    paused = client.fine_tuning.jobs.pause(job.id)
    assert paused.status == "paused"
    assert client.fine_tuning.jobs.resume(job.id).status == "queued"
    with pytest.raises(openai.ConflictError) as conflict:
        client.fine_tuning.jobs.resume(job.id)
    assert conflict.value.code == "invalid_job_status"

    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        row = session.query(Job).filter_by(id=job.id).one()
        service.record_checkpoint(session=session, job=row, step_number=3, model_ref=f"{job.id}:step-3",
                                  metrics={"full_valid_loss": 0.5, "train_mean_token_accuracy": 0.25})
    engine.dispose()
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id)
    assert [c.step_number for c in checkpoints] == [3]
    checkpoint = strict(FineTuningJobCheckpoint, checkpoints.data[0])
    assert checkpoint.metrics.full_valid_loss == 0.5 and checkpoint.fine_tuning_job_id == job.id

    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    strict(FineTuningJob, cancelled)

    events = client.fine_tuning.jobs.list_events(job.id, limit=50)
    for event in events.data:
        strict(FineTuningJobEvent, event)
    assert events.data[0].message == "Job cancelled by user."
    messages = [e.message for e in events.data]
    assert "Job paused by user." in messages and "Job resumed by user." in messages
    # The SDK's auto-pagination follows `after` through every page.
    assert [e.id for e in client.fine_tuning.jobs.list_events(job.id, limit=2)] == [e.id for e in events.data]

    deleted = client.files.delete(uploaded.id)
    strict(FileDeleted, deleted)
    assert deleted.deleted is True


def test_sdk_errors_carry_code_and_param(client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="sk-wrong", max_retries=0).files.list()
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-missing")
    uploaded = client.files.create(file=("t.jsonl", io.BytesIO(jsonl(question_rows(1)))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as bad:
        client.fine_tuning.jobs.create(
            model="SmolLM2-135M-Instruct", training_file=uploaded.id,
            method={"type": "reinforcement", "reinforcement": {
                "grader": {"type": "string_check", "name": "g", "input": "a", "reference": "b", "operation": "eq"},
                "hyperparameters": {"batch_size": 100000}}},
        )
    assert bad.value.param == "method.reinforcement.hyperparameters.batch_size"
    assert bad.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client.files.create(file=("t.jsonl", io.BytesIO(b"{}")), purpose="assistants")
    assert wrong_purpose.value.param == "purpose"
