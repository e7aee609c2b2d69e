"""A succeeded job's `result_files`: its step metrics as a `fine-tune-results` file named
step_metrics.csv, written in the transaction of the status change, read back with the official
openai SDK against a live server (retrieve, content, list by purpose, delete)."""

from __future__ import annotations

import csv
import io

import openai
import pytest
from sqlalchemy import select

from app.files.models import StoredFile
from tests.conftest import live_server
from tests.dashboard.helpers import login
from tests.test_internal import Worker, metrics_data, queued_job


@pytest.fixture
def worker(client, settings) -> Worker:  # noqa: ANN001
    return Worker(client, settings.worker_token.get_secret_value())


def test_a_succeeded_job_has_its_step_metrics_as_a_csv_result_file(api, app, client, worker, project, settings):
    job_id = queued_job(api)
    worker.claim(job_id)
    pushed = {1: metrics_data(1, 0.25), 2: metrics_data(2, 0.5), 3: metrics_data(3, 1.0)}
    pushed[3]["scores"]["valid_reward_mean"] = 0.75  # a metric only some steps report
    for step, data in pushed.items():
        assert worker.leased("PUT", f"/jobs/{job_id}/steps/{step}", metrics=data).status_code == 200
    for _ in range(2):  # the retry of a finish whose answer was lost creates no second file
        finished = worker.leased("POST", f"/jobs/{job_id}/finish", status="succeeded")
        assert finished.status_code == 200 and finished.json()["status"] == "succeeded"

    with live_server(settings) as base_url, \
            openai.OpenAI(base_url=f"{base_url}/v1", api_key=project["key"], max_retries=0) as sdk:
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        assert job.status == "succeeded" and len(job.result_files) == 1
        file_id = job.result_files[0]
        text = sdk.files.content(file_id).text
        stored = sdk.files.retrieve(file_id)
        assert (stored.purpose, stored.filename, stored.status) == ("fine-tune-results", "step_metrics.csv", "processed")
        assert stored.bytes == len(text.encode())

        header = text.splitlines()[0].split(",")
        assert header[0] == "step" and header[1:] == sorted(header[1:])
        assert {"scores.train_reward_mean", "scores.valid_reward_mean", "train.loss",
                "tools.tool_calls_per_rollout_by_tool.search"} <= set(header)
        rows = list(csv.DictReader(io.StringIO(text)))
        assert [int(r["step"]) for r in rows] == [1, 2, 3]
        assert [float(r["scores.train_reward_mean"]) for r in rows] == [0.25, 0.5, 1.0]
        assert [r["scores.valid_reward_mean"] for r in rows] == ["", "", "0.75"]
        assert all(float(r["usage.completion_tokens"]) == 512 and float(r["timing.step_s"]) == 3.5 for r in rows)

        # The dashboard's download is the same table.
        login(client, project["key"])
        assert client.get(f"/dashboard/jobs/{job_id}/metrics.csv").text == text

        assert [f.id for f in sdk.files.list(purpose="fine-tune-results")] == [file_id]
        assert file_id not in [f.id for f in sdk.files.list(purpose="fine-tune")]
        assert file_id in [f.id for f in sdk.files.list()]
        with pytest.raises(openai.BadRequestError) as refused:  # results are no training data
            sdk.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=file_id, method={
                "type": "reinforcement", "reinforcement": {"grader": {
                    "type": "string_check", "name": "x", "input": "a", "reference": "a", "operation": "eq"}}})
        assert refused.value.code == "invalid_file_purpose"

        with app.state.session_factory() as session:
            key = session.scalar(select(StoredFile.storage_key).where(StoredFile.id == file_id))
        assert sdk.files.delete(file_id).deleted
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(file_id)
        assert not (app.state.storage.root / key).exists()


def test_failed_and_cancelled_jobs_have_no_result_files(api, worker):
    for status, body in (("failed", {"error": {"code": "worker_error", "message": "boom", "param": None}}),
                         ("cancelled", {})):
        job_id = queued_job(api)
        worker.claim(job_id)
        worker.leased("PUT", f"/jobs/{job_id}/steps/1", metrics=metrics_data(1, 0.5))
        if status == "cancelled":
            api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        assert worker.leased("POST", f"/jobs/{job_id}/finish", status=status, **body).json()["status"] == status
        assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["result_files"] == []
    assert api.get("/v1/files", params={"purpose": "fine-tune-results"}).json()["data"] == []
