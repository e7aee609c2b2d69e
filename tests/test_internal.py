"""The internal worker API (/internal/v1): worker-token auth, leases and heartbeats, idempotent
pushes, checkpoint retention, the finish call, and the watchdog that re-queues silent jobs."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.core.config import Settings
from app.core.db import utcnow
from app.core.migrations import upgrade
from app.files.models import StoredFile
from app.jobs.models import JobMetric, JobStep
from app.jobs.watchdog import expire_job_leases as expire_leases
from app.main import create_app
from tests.conftest import Api, job_body, make_project, question_rows, wait_for
from tests.test_queue import queued_job_ids


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201
    # The tests drive the watchdog's rounds themselves (expire_leases), not a timer.
    return settings.model_copy(update={"watchdog_interval_s": 3600})


class Worker:
    """A worker process as the control plane sees it: a worker token, an id, and the lease it holds."""

    def __init__(self, client: TestClient, token: str, worker_id: str = "gpu-1") -> None:
        self.client, self.worker_id = client, worker_id
        self.headers = {"Authorization": f"Bearer {token}"}
        self.lease_id: str | None = None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None):  # noqa: ANN201
        return self.client.request(method, f"/internal/v1{path}", json=body, headers=self.headers)

    def claim(self, job_id: str):  # noqa: ANN201
        response = self.call("POST", f"/jobs/{job_id}/claim", {"worker_id": self.worker_id})
        if response.status_code == 200:
            self.lease_id = response.json()["lease_id"]
        return response

    def leased(self, method: str, path: str, /, **body: Any):  # noqa: ANN201
        return self.call(method, path, {"lease_id": self.lease_id, **body})


@pytest.fixture
def worker(client, settings) -> Worker:  # noqa: ANN001
    return Worker(client, settings.worker_token.get_secret_value())


def queued_job(api: Api, **overrides: Any) -> str:
    file_id = api.upload_ok(question_rows())
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, **overrides)).json()["id"]
    wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued")
    return job_id


def queued_supervised_job(api: Api, **supervised: Any) -> str:
    """A supervised job on chat rows, queued; `supervised` is its method.supervised."""
    from tests.test_supervised_api import chat_rows  # that module imports this one

    body = {"model": "SmolLM2-135M-Instruct", "training_file": api.upload_ok(chat_rows()),
            "method": {"type": "supervised", "supervised": supervised}}
    job_id = api.post("/v1/fine_tuning/jobs", json=body).json()["id"]
    wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued")
    return job_id


def events(api: Api, job_id: str) -> list[dict[str, Any]]:
    return api.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]


def messages(api: Api, job_id: str) -> list[str]:
    return [e["message"] for e in events(api, job_id)]


def status(api: Api, job_id: str) -> str:
    return api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"]


def metrics_data(step: int, reward: float) -> dict[str, Any]:
    return {"step": step, "total_steps": 10, "scores": {"train_reward_mean": reward, "exact": reward},
            "usage": {"completion_tokens": 512}, "errors": {"tool_failures": 0}, "timing": {"step_s": 3.5},
            "tools": {"tool_calls_per_rollout": 1.5, "tool_calls_per_rollout_by_tool": {"search": 1.5}},
            "train": {"loss": 0.12, "frac_reward_zero_std": 0.25}}


def supervised_metrics_data(step: int, total: int, *, eval_every: int) -> dict[str, Any]:
    """A supervised step's metrics as the trainer builds them (workers/methods/supervised/trainer.py), the loss
    falling as 1/step: validation at eval steps and the last, full validation at the last."""
    from workers.methods.supervised.loss import TokenScores
    from workers.methods.supervised.trainer import _step_metrics

    def scores(loss: float) -> TokenScores:
        return TokenScores(loss=loss, accuracy=1 - loss / 2, tokens=40, grad_norm=0.5)

    evaluating = step % eval_every == 0 or step == total
    return _step_metrics(step, total, scores(1.0 / step), scores(1.2 / step) if evaluating else None,
                         scores(1.1 / step) if step == total else None, learning_rate=2e-4, step_s=0.25)


def test_internal_api_refuses_missing_or_wrong_worker_token(client, api, project):
    job_id = queued_job(api)
    for headers, code in (({}, "missing_worker_token"),
                          ({"Authorization": "Bearer not-the-token"}, "invalid_worker_token"),
                          ({"Authorization": f"Bearer {project['key']}"}, "invalid_worker_token")):
        response = client.post(f"/internal/v1/jobs/{job_id}/claim", json={"worker_id": "w"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == code and response.json()["error"]["type"] == "invalid_request_error"
    assert status(api, job_id) == "queued"


def test_claim_starts_the_job_with_its_full_spec(api, worker, project):
    job_id = queued_job(api, suffix="fin", seed=11)
    response = worker.claim(job_id)
    assert response.status_code == 200, response.text
    claim = response.json()
    assert claim["lease_id"] and claim["lease_expires_at"] > utcnow().timestamp() + 30
    job = claim["job"]
    assert job["id"] == job_id and job["project_id"] == project["project_id"] and job["project_name"] == project["name"]
    assert job["model"] == "SmolLM2-135M-Instruct" and job["seed"] == 11 and job["suffix"] == "fin"
    assert job["training_file"].startswith("file-") and job["validation_file"] is None
    # Workers need the real tool headers; users only ever see them masked.
    assert job["method"]["reinforcement"]["tools"][0]["headers"] == {"Authorization": "Bearer tool-secret-abcdef123456"}
    assert job["resume_state"] is None and job["completed_steps"] == 0 and job["resolved_hyperparameters"] is None
    assert status(api, job_id) == "running"
    assert messages(api, job_id)[0] == "Job started on worker gpu-1"


def test_a_live_lease_is_not_taken_and_a_repeated_claim_keeps_it(api, worker, client, settings):
    job_id = queued_job(api)
    first = worker.claim(job_id).json()
    other = Worker(client, settings.worker_token.get_secret_value(), "gpu-2").claim(job_id)
    assert other.status_code == 409 and other.json()["error"]["code"] == "lease_held"
    again = worker.claim(job_id)  # e.g. the claim's answer was lost and the worker asks again
    assert again.status_code == 200 and again.json()["lease_id"] == first["lease_id"]


@pytest.mark.parametrize("action,status_name", [("pause", "paused"), ("cancel", "cancelled")])
def test_paused_or_cancelled_jobs_are_not_claimable(api, worker, action, status_name):
    job_id = queued_job(api)
    api.post(f"/v1/fine_tuning/jobs/{job_id}/{action}")
    response = worker.claim(job_id)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "not_claimable" and f"'{status_name}'" in error["message"]


def test_claim_of_an_unknown_job_is_404(worker):
    assert worker.claim("ftjob-nope").status_code == 404


def test_heartbeat_relays_pause_and_the_worker_saves_state(api, client, settings, worker):
    job_id = queued_job(api)
    claim = worker.claim(job_id).json()
    beat = worker.leased("POST", f"/jobs/{job_id}/heartbeat")
    assert beat.json()["action"] == "continue" and beat.json()["lease_expires_at"] >= claim["lease_expires_at"]
    api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "pause"
    saved = worker.leased("POST", f"/jobs/{job_id}/state", completed_steps=4, resume_state="/ckpt/job/state-4",
                          resolved_hyperparameters=None, trained_tokens=1000)
    assert saved.status_code == 200
    finished = worker.leased("POST", f"/jobs/{job_id}/finish", status="paused", error=None, trained_tokens=1000)
    assert finished.json()["status"] == "paused"
    assert messages(api, job_id)[0] == "Training state saved at step 4; job paused"
    # Resumed, the next claim starts where the paused worker stopped.
    api.post(f"/v1/fine_tuning/jobs/{job_id}/resume")
    job = Worker(client, settings.worker_token.get_secret_value(), "gpu-2").claim(job_id).json()["job"]
    assert job["resume_state"] == "/ckpt/job/state-4" and job["completed_steps"] == 4


def test_a_resume_before_the_worker_heard_the_pause_leaves_the_job_with_that_worker(api, client, settings, worker):
    # Pause and resume land between two heartbeats: no second run is queued, the worker carries on.
    job_id = queued_job(api)
    lease = worker.claim(job_id).json()["lease_id"]
    api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
    resumed = api.post(f"/v1/fine_tuning/jobs/{job_id}/resume").json()
    assert resumed["status"] == "running"
    assert messages(api, job_id)[0] == "Job resumed by user; worker gpu-1 had not stopped for the pause and keeps running it."
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "continue"
    other = Worker(client, settings.worker_token.get_secret_value(), "gpu-2").claim(job_id)
    assert other.status_code == 409 and other.json()["error"]["code"] == "lease_held"
    assert worker.lease_id == lease and worker.leased("PUT", f"/jobs/{job_id}/steps/1",
                                                      metrics=metrics_data(1, 0.5)).status_code == 200
    assert messages(api, job_id).count("Job sent to the training queue.") == 1  # at creation only


def test_a_resume_while_the_worker_saves_its_state_queues_the_job_once_it_stopped(api, client, settings, worker):
    job_id = queued_job(api)
    worker.claim(job_id)
    api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "pause"
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/resume").json()["status"] == "running"  # still its worker's
    gpu2 = Worker(client, settings.worker_token.get_secret_value(), "gpu-2")
    assert gpu2.claim(job_id).json()["error"]["code"] == "lease_held"
    worker.leased("POST", f"/jobs/{job_id}/state", completed_steps=4, resume_state="/ckpt/job/state-4")
    finished = worker.leased("POST", f"/jobs/{job_id}/finish", status="paused", error=None)
    assert finished.json()["status"] == "queued"
    assert messages(api, job_id)[0:2] == ["Job sent to the training queue.",
                                          "Worker gpu-1 stopped for a pause that was withdrawn; job re-queued from step 4"]
    job = gpu2.claim(job_id).json()["job"]
    assert job["completed_steps"] == 4 and status(api, job_id) == "running"


def test_heartbeat_relays_cancel_and_the_worker_stops(api, worker):
    job_id = queued_job(api)
    worker.claim(job_id)
    api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "cancel"
    assert worker.leased("POST", f"/jobs/{job_id}/finish", status="cancelled").json()["status"] == "cancelled"
    assert messages(api, job_id)[0] == "Worker stopped: job cancelled"
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["error"]["code"] == "lease_lost"


def test_an_expired_lease_is_taken_over_and_the_old_lease_refused_everywhere(api, app, client, settings, worker):
    job_id = queued_job(api)
    app.state.settings = settings.model_copy(update={"lease_seconds": 0})  # leases that expire at once
    worker.claim(job_id)
    app.state.settings = settings
    successor = Worker(client, settings.worker_token.get_secret_value(), "gpu-2")
    assert successor.claim(job_id).status_code == 200
    assert messages(api, job_id)[0] == "Worker gpu-1 lost its lease; gpu-2 takes over"
    assert events(api, job_id)[0]["level"] == "warn"
    writes = [
        ("POST", "heartbeat", {}),
        ("PUT", "steps/1", {"metrics": metrics_data(1, 0.5)}),
        ("POST", "events", {"key": "k1", "level": "info", "message": "hello"}),
        ("POST", "rollouts", {"step": 1, "split": "train", "records": [{"trace_id": "trace_a", "sample_index": 0}]}),
        ("PUT", "checkpoints/1", {"path": "/ckpt/1", "metrics": {"valid_reward_mean": 0.5}}),
        ("POST", "state", {"completed_steps": 1, "resume_state": "/ckpt/s1"}),
        ("POST", "finish", {"status": "succeeded"}),
    ]
    for method, path, body in writes:
        response = worker.leased(method, f"/jobs/{job_id}/{path}", **body)
        assert response.status_code == 409 and response.json()["error"]["code"] == "lease_lost", (path, response.text)
    assert status(api, job_id) == "running"
    assert successor.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "continue"


def test_step_metrics_are_stored_once(api, app, worker):
    job_id = queued_job(api)
    worker.claim(job_id)
    data = metrics_data(1, 0.25)
    first = worker.leased("PUT", f"/jobs/{job_id}/steps/1", metrics=data)
    again = worker.leased("PUT", f"/jobs/{job_id}/steps/1", metrics=data)
    assert first.json() == {"step": 1, "created": True} and again.json() == {"step": 1, "created": False}
    metric_events = [e for e in events(api, job_id) if e["type"] == "metrics"]
    assert len(metric_events) == 1
    assert metric_events[0]["message"] == "Step 1/10: train reward 0.250"
    assert metric_events[0]["data"]["scores"]["train_reward_mean"] == 0.25
    assert metric_events[0]["data"]["tools"]["tool_calls_per_rollout_by_tool"] == {"search": 1.5}
    with app.state.session_factory() as session:
        assert session.scalar(select(func.count()).select_from(JobStep).where(JobStep.job_id == job_id)) == 1
        series = dict(session.execute(select(JobMetric.key, JobMetric.value).where(JobMetric.job_id == job_id)).all())
    assert len(series) == 9  # every number of the event, each once
    assert series["scores.train_reward_mean"] == 0.25 and series["tools.tool_calls_per_rollout_by_tool.search"] == 1.5
    assert series["train.frac_reward_zero_std"] == 0.25 and "step" not in series
    mismatch = worker.leased("PUT", f"/jobs/{job_id}/steps/2", metrics=metrics_data(3, 0.1))
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "metrics.step"


def test_a_supervised_steps_event_reads_like_openais(api, worker):
    job_id = queued_supervised_job(api)
    worker.claim(job_id)
    for step in (1, 2, 3):
        metrics = supervised_metrics_data(step, 3, eval_every=2)
        pushed = worker.leased("PUT", f"/jobs/{job_id}/steps/{step}", metrics=metrics)
        assert pushed.status_code == 200, pushed.text
    metric_events = [e for e in events(api, job_id) if e["type"] == "metrics"][::-1]
    assert [e["message"] for e in metric_events] == [
        "Step 1/3: training loss=1.000",
        "Step 2/3: training loss=0.500, validation loss=0.600",
        "Step 3/3: training loss=0.333, validation loss=0.400, full validation loss=0.367",
    ]
    assert metric_events[2]["data"]["full_valid_mean_token_accuracy"] == pytest.approx(1 - 1.1 / 3 / 2)


def test_worker_events_are_written_once_per_key(api, worker):
    job_id = queued_job(api)
    worker.claim(job_id)
    body = {"key": "lease-x:1", "level": "warn", "message": "Tool 'search' answered 503; retrying", "data": {"n": 1}}
    first, again = (worker.leased("POST", f"/jobs/{job_id}/events", **body) for _ in range(2))
    assert first.json()["created"] is True and again.json() == {"id": first.json()["id"], "created": False}
    shown = [e for e in events(api, job_id) if e["message"] == body["message"]]
    assert [(e["id"], e["level"], e["data"]) for e in shown] == [(first.json()["id"], "warn", {"n": 1})]


def rollout(trace_id: str, index: int, reward: float | None, calls: int = 1) -> dict[str, Any]:
    return {"trace_id": trace_id, "sample_index": index, "reward": reward, "finish_reason": "answered",
            "tool_calls": [{"name": "search"}] * calls, "final_answer": "42"}


def test_rollouts_are_stored_once_and_listed_to_their_project_only(api, client, settings, worker):
    job_id = queued_job(api)
    worker.claim(job_id)

    def push(step: int, split: str, records: list[dict[str, Any]]) -> dict[str, Any]:
        return worker.leased("POST", f"/jobs/{job_id}/rollouts", step=step, split=split, records=records).json()

    assert push(1, "train", [rollout("t1", 0, 1.0, 2), rollout("t2", 0, 0.0), rollout("t3", 1, None, 0)]) == {"stored": 3}
    assert push(1, "train", [rollout("t2", 0, 0.0), rollout("t4", 1, 0.5)]) == {"stored": 1}
    assert push(2, "valid", [rollout("v1", 0, 1.0)]) == {"stored": 1}

    url = f"/v1/fine_tuning/jobs/{job_id}/rollouts"
    listed = api.get(url).json()
    assert [r["id"] for r in listed["data"]] == ["v1", "t4", "t3", "t2", "t1"]  # newest step first
    first = listed["data"][-1]
    assert first == {"object": "fine_tuning.job.rollout", "id": "t1", "step": 1, "split": "train", "sample_index": 0,
                     "reward": 1.0, "finish_reason": "answered", "tool_calls": 2, "data": rollout("t1", 0, 1.0, 2)}
    assert [r["id"] for r in api.get(url, params={"split": "train", "step": 1}).json()["data"]] == ["t4", "t3", "t2", "t1"]
    page = api.get(url, params={"limit": 2}).json()
    assert [r["id"] for r in page["data"]] == ["v1", "t4"] and page["has_more"] and page["last_id"] == "t4"
    rest = api.get(url, params={"limit": 2, "after": page["last_id"]}).json()
    assert [r["id"] for r in rest["data"]] == ["t3", "t2"]

    stranger = Api(client, make_project(settings)["key"])
    assert stranger.get(url).status_code == 404


def test_nul_characters_surrogates_and_nan_from_a_worker_are_stored_not_refused(api, worker):
    # A random-weight model decodes token 0 as NUL, and a tool may return one or a lone "\ud800" escape;
    # PostgreSQL's JSONB and text refuse them (and JSONB refuses NaN): the push must still be stored,
    # never answered with a 5xx.
    job_id = queued_job(api)
    worker.claim(job_id)
    record = {**rollout("t-nul", 0, 0.5), "final_answer": "ab\x00c", "messages": [{"content": "x\x00"}], "x\x00": 1,
              "tool_output": "y\ud800", "score": float("nan")}
    body = json.dumps({"lease_id": worker.lease_id, "step": 1, "split": "train", "records": [record]})  # NaN as Python writes it
    stored = worker.client.post(f"/internal/v1/jobs/{job_id}/rollouts", content=body,
                                headers={**worker.headers, "Content-Type": "application/json"})
    assert stored.status_code == 200 and stored.json() == {"stored": 1}
    event = worker.leased("POST", f"/jobs/{job_id}/events", key="k-nul", level="warn",
                          message="tool said \x00", data={"raw": "\x00"})
    assert event.status_code == 200
    step = worker.leased("PUT", f"/jobs/{job_id}/steps/1", metrics={**metrics_data(1, 0.5), "note": "a\x00"})
    assert step.status_code == 200
    data = api.get(f"/v1/fine_tuning/jobs/{job_id}/rollouts").json()["data"][0]["data"]
    assert data["final_answer"] == "ab\ufffdc" and data["messages"] == [{"content": "x\ufffd"}]
    assert data["x\ufffd"] == 1 and data["score"] is None
    assert data["tool_output"] == "y\ufffd"
    shown = next(e for e in events(api, job_id) if e["level"] == "warn")
    assert shown["message"] == "tool said \ufffd" and shown["data"] == {"raw": "\ufffd"}


def push_checkpoints(worker, job_id: str, metrics_of) -> list[str]:  # noqa: ANN001
    """Checkpoints at steps 1-5 scoring 0.1, 0.5, 0.3, 0.9, 0.2; the paths the control plane dropped."""
    deleted: list[str] = []
    for step, score in enumerate([0.1, 0.5, 0.3, 0.9, 0.2], start=1):
        answer = worker.leased("PUT", f"/jobs/{job_id}/checkpoints/{step}", path=f"/ckpt/{job_id}/step-{step}",
                               metrics=metrics_of(score))
        assert answer.status_code == 200 and answer.json()["created"] is True and answer.json()["id"].startswith("ftckpt_")
        deleted += answer.json()["delete_paths"]
    return deleted


def test_checkpoints_keep_the_three_best_and_the_latest(api, worker, project):
    job_id = queued_job(api)
    worker.claim(job_id)
    deleted = push_checkpoints(worker, job_id, lambda reward: {"scores": {"valid_reward_mean": reward,
                                                                          "train_reward_mean": reward / 2}})
    assert deleted == [f"/ckpt/{job_id}/step-1"]
    repeat = worker.leased("PUT", f"/jobs/{job_id}/checkpoints/5", path=f"/ckpt/{job_id}/step-5", metrics={})
    assert repeat.json()["created"] is False and repeat.json()["delete_paths"] == []

    listed = api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert sorted(c["step_number"] for c in listed) == [2, 3, 4, 5]
    by_step = {c["step_number"]: c for c in listed}
    assert by_step[4]["fine_tuned_model_checkpoint"] == f"ft:SmolLM2-135M-Instruct:{project['name']}::{job_id}:ckpt-step-4"
    assert by_step[4]["metrics"] == {"step": 4, "scores": {"valid_reward_mean": 0.9, "train_reward_mean": 0.45}}
    assert messages(api, job_id).count("Checkpoint created at step 5") == 1


@pytest.mark.parametrize("make_job,metrics_of", [
    (queued_job, lambda score: {"scores": {"valid_reward_mean": score}}),  # a reinforcement trainer's step metrics
    (queued_supervised_job, lambda score: {"valid_loss": 1 - score, "train_loss": 1.0}),  # supervised: lower is better
], ids=["reward", "loss"])
def test_checkpoints_kept_are_the_best_by_validation_as_trainers_report_it(api, worker, make_job, metrics_of):
    """Each method's checkpoints rank by its own score (app/jobs/methods/)."""
    job_id = make_job(api)
    worker.claim(job_id)
    assert push_checkpoints(worker, job_id, metrics_of) == [f"/ckpt/{job_id}/step-1"]  # the worst; step 5 is latest
    listed = api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert sorted(c["step_number"] for c in listed) == [2, 3, 4, 5]


def test_finish_succeeded_names_the_model_and_a_retry_changes_nothing(api, worker, project):
    job_id = queued_job(api)
    worker.claim(job_id)
    resolved = {"batch_size": 4, "n_epochs": 2, "learning_rate_multiplier": 1.0, "group_size": 4}
    worker.leased("POST", f"/jobs/{job_id}/state", completed_steps=6, resume_state="/ckpt/s6",
                  resolved_hyperparameters=resolved, trained_tokens=900)
    first = worker.leased("POST", f"/jobs/{job_id}/finish", status="succeeded", error=None, trained_tokens=1234)
    retry = worker.leased("POST", f"/jobs/{job_id}/finish", status="succeeded", error=None, trained_tokens=1234)
    model = f"ft:SmolLM2-135M-Instruct:{project['name']}::{job_id}"
    assert first.status_code == retry.status_code == 200
    assert first.json() == retry.json() == {"status": "succeeded", "fine_tuned_model": model}
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["fine_tuned_model"] == model and job["trained_tokens"] == 1234
    assert job["finished_at"] and len(job["result_files"]) == 1
    results = api.get("/v1/files", params={"purpose": "fine-tune-results"}).json()["data"]
    assert [f["id"] for f in results] == job["result_files"]  # the retried finish made no second file
    # The "auto" hyperparameters show the values the worker trained with.
    assert job["hyperparameters"] == {"batch_size": 4, "learning_rate_multiplier": 1.0, "n_epochs": 2}
    assert job["method"]["reinforcement"]["hyperparameters"]["batch_size"] == 4
    assert "group_size" not in job["method"]["reinforcement"]["hyperparameters"]
    assert messages(api, job_id).count("The job has successfully completed") == 1
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["error"]["code"] == "lease_lost"
    worker.lease_id = "lease_someone-else"
    assert worker.leased("POST", f"/jobs/{job_id}/finish", status="succeeded").status_code == 409


def test_finish_failed_records_the_error(api, worker):
    job_id = queued_job(api)
    worker.claim(job_id)
    error = {"code": "worker_error", "message": "CUDA out of memory", "param": None}
    assert worker.leased("POST", f"/jobs/{job_id}/finish", status="failed", error=error).json()["status"] == "failed"
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"] == error
    latest = events(api, job_id)[0]
    assert latest["level"] == "error" and "CUDA out of memory" in latest["message"]


def test_worker_reads_any_projects_file(app, client, settings, worker):
    content = b'{"messages": [{"role": "user", "content": "hi"}]}\n'
    file_ids = [Api(client, make_project(settings)["key"]).upload_ok(content) for _ in range(2)]
    for file_id in file_ids:
        response = worker.call("GET", f"/files/{file_id}/content")
        assert response.status_code == 200 and response.content == content
    assert worker.call("GET", "/files/file-nope/content").status_code == 404
    with app.state.session_factory() as session:
        key = session.scalar(select(StoredFile.storage_key).where(StoredFile.id == file_ids[0]))
    app.state.storage.delete(key)
    missing = worker.call("GET", f"/files/{file_ids[0]}/content")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "file_content_missing"


def test_watchdog_requeues_a_job_whose_worker_went_silent(api, app, client, worker, settings, redis_client):
    job_id = queued_job(api)
    wait_for(lambda: queued_job_ids(redis_client, settings.training_queue) == [job_id])
    worker.claim(job_id)
    worker.leased("POST", f"/jobs/{job_id}/state", completed_steps=3, resume_state="/ckpt/s3")
    factory, queue = app.state.session_factory, app.state.queue
    assert expire_leases(factory, queue) == []  # the lease is live

    later = utcnow() + timedelta(seconds=settings.lease_seconds + 1)
    assert expire_leases(factory, queue, now=later) == [job_id]
    assert status(api, job_id) == "queued"
    warning = next(e for e in events(api, job_id) if e["level"] == "warn")
    assert warning["message"] == "Worker gpu-1 stopped sending heartbeats; job re-queued from step 3"
    assert queued_job_ids(redis_client, settings.training_queue) == [job_id, job_id]
    assert messages(api, job_id)[0] == "Job sent to the training queue."
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["error"]["code"] == "lease_lost"

    successor = Worker(client, settings.worker_token.get_secret_value(), "gpu-2")
    resumed = successor.claim(job_id).json()["job"]
    assert resumed["resume_state"] == "/ckpt/s3" and resumed["completed_steps"] == 3


def test_the_first_watchdog_round_after_a_restart_does_not_count_the_outage_against_workers(api, app, worker,
                                                                                          settings):
    """An API down longer than the lease: its first round (restart grace) gives the running job one
    lease from then instead of re-queueing it; a round past that grace re-queues it as usual."""
    job_id = queued_job(api)
    worker.claim(job_id)
    factory, queue = app.state.session_factory, app.state.queue
    restarted = utcnow() + timedelta(seconds=settings.lease_seconds + 30)  # the lease ran out while down
    assert expire_leases(factory, queue, now=restarted, restart_grace_s=settings.lease_seconds) == []
    assert status(api, job_id) == "running"
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").status_code == 200  # its worker goes on
    past_grace = restarted + timedelta(seconds=2 * settings.lease_seconds + 1)
    assert expire_leases(factory, queue, now=past_grace) == [job_id]
    assert status(api, job_id) == "queued"


def test_watchdog_clears_the_expired_lease_of_a_paused_job(api, app, worker, settings):
    job_id = queued_job(api)
    worker.claim(job_id)
    api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")  # and the worker dies before saving its state
    later = utcnow() + timedelta(seconds=settings.lease_seconds + 1)
    assert expire_leases(app.state.session_factory, app.state.queue, now=later) == []
    assert status(api, job_id) == "paused"
    assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["error"]["code"] == "lease_lost"


def test_the_running_server_requeues_jobs_without_a_live_worker(settings, project, redis_client):
    fast = settings.model_copy(update={"watchdog_interval_s": 0.1, "lease_seconds": 0})
    with TestClient(create_app(fast)) as client:
        api = Api(client, project["key"])
        job_id = queued_job(api)
        assert Worker(client, fast.worker_token.get_secret_value()).claim(job_id).status_code == 200
        wait_for(lambda: len(queued_job_ids(redis_client, fast.training_queue)) == 2)
        assert status(api, job_id) == "queued"


def test_internal_routes_are_documented_under_their_own_tag(client):
    paths = client.get("/openapi.json").json()["paths"]
    internal = {p for p in paths if p.startswith("/internal/v1/")}
    assert {"/internal/v1/jobs/{job_id}/claim", "/internal/v1/jobs/{job_id}/finish",
            "/internal/v1/files/{file_id}/content"} <= internal
    for path in internal:
        assert all(op["tags"] == ["internal"] for op in paths[path].values())
    assert not any("internal" in op.get("tags", []) for p, ops in paths.items() if p.startswith("/v1/") for op in ops.values())
    assert "/v1/fine_tuning/jobs/{fine_tuning_job_id}/rollouts" in paths


def test_the_worker_api_on_the_embedded_sqlite_default(tmp_path, monkeypatch):
    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    embedded = Settings(_env_file=None, data_dir=tmp_path, outbound_allowlist=["127.0.0.1"], watchdog_interval_s=3600)
    upgrade(embedded.resolved_database_url)
    project = make_project(embedded)
    with TestClient(create_app(embedded)) as client:
        api = Api(client, project["key"])
        job_id = queued_job(api)
        worker = Worker(client, embedded.worker_token.get_secret_value())
        assert worker.claim(job_id).status_code == 200
        assert worker.claim(job_id).status_code == 200  # its own live lease (naive SQLite datetimes compare)
        assert worker.leased("POST", f"/jobs/{job_id}/heartbeat").json()["action"] == "continue"
        assert worker.leased("PUT", f"/jobs/{job_id}/steps/1", metrics=metrics_data(1, 0.5)).json()["created"] is True
        assert worker.leased("POST", f"/jobs/{job_id}/rollouts", step=1, split="train",
                             records=[rollout("t1", 0, 1.0)]).json() == {"stored": 1}
        assert worker.leased("PUT", f"/jobs/{job_id}/checkpoints/1", path="/c/1", metrics={}).json()["created"] is True
        later = utcnow() + timedelta(seconds=embedded.lease_seconds + 1)
        assert expire_leases(client.app.state.session_factory, client.app.state.queue, now=later) == [job_id]
        assert status(api, job_id) == "queued"
