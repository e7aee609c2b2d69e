"""The diagnostics API as users and workers see it: creation with the jobs' checks, validation,
the broker hand-off, project scoping, the worker's claim/heartbeat/pushes/finish, results,
cancel, the rollouts listing, the watchdog, and a job's diagnostic."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from typing import Any

import pytest

from app.core.db import make_engine, make_session_factory, utcnow
from app.diagnostics.watchdog import expire_diagnostic_leases as expire_leases
from tests.conftest import Api, job_body, make_project, question_rows, wait_for
from tests.test_internal import Worker

BASE = "/v1/fine_tuning/alpha/diagnostics"


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201
    return settings.model_copy(update={"watchdog_interval_s": 3600})


@pytest.fixture
def worker(client, settings) -> Worker:  # noqa: ANN001
    return Worker(client, settings.worker_token.get_secret_value())


def diagnostic_body(file_id: str, **overrides: Any) -> dict[str, Any]:
    body = job_body(file_id)
    body.update(overrides)
    return body


def queued_tasks(redis_client, queue: str) -> list[tuple[str, str]]:  # noqa: ANN001
    tasks = []
    for raw in reversed(redis_client.lrange(queue, 0, -1)):
        message = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(message["body"]))
        tasks.append((message["headers"]["task"], args[0]))
    return tasks


def queued_diagnostic(api: Api, rows: int = 3, **overrides: Any) -> dict[str, Any]:
    file_id = api.upload_ok(question_rows(rows))
    created = api.post(BASE, json=diagnostic_body(file_id, **overrides))
    assert created.status_code == 200, created.text
    diag_id = created.json()["id"]
    return wait_for(lambda: (d := api.get(f"{BASE}/{diag_id}").json())["status"] == "queued" and d)


def test_create_validate_and_send_to_the_workers(api, settings, redis_client):
    file_id = api.upload_ok(question_rows(5))
    created = api.post(BASE, json=diagnostic_body(file_id, runs_per_sample=4, max_samples=3, seed=11,
                                                  metadata={"team": "finance"}, non_read_only_tools="dry_run"))
    assert created.status_code == 200, created.text
    diag = created.json()
    assert diag["object"] == "fine_tuning.diagnostic" and diag["id"].startswith("diag-")
    assert diag["status"] == "validating_files" and diag["runs_per_sample"] == 4 and diag["max_samples"] == 3
    assert diag["seed"] == 11 and diag["metadata"] == {"team": "finance"} and diag["fine_tuning_job_id"] is None
    assert diag["non_read_only_tools"] == "dry_run"
    # Tool headers are masked, as on a job.
    assert diag["method"]["reinforcement"]["tools"][0]["headers"]["Authorization"] == "****3456"
    queued = wait_for(lambda: (d := api.get(f"{BASE}/{diag['id']}").json())["status"] == "queued" and d)
    assert queued["progress"] == {"samples_done": 0, "samples_total": 3, "rollouts_done": 0, "rollouts_total": 12}
    wait_for(lambda: queued_tasks(redis_client, settings.training_queue))
    assert queued_tasks(redis_client, settings.training_queue) == [("agent_rft.run_diagnostic", diag["id"])]
    listed = api.get(BASE).json()
    assert [d["id"] for d in listed["data"]] == [diag["id"]] and listed["data"][0]["samples"] is None


@pytest.mark.parametrize(("change", "param"), [
    (lambda b: b.update(runs_per_sample=1), "runs_per_sample"),
    (lambda b: b.update(max_samples=0), "max_samples"),
    (lambda b: b.update(validation_file="file-x"), "validation_file"),
    (lambda b: b.pop("method"), "method"),
    (lambda b: b["method"]["reinforcement"].update(max_episode_steps=0), "method.reinforcement.max_episode_steps"),
    (lambda b: b["method"]["reinforcement"]["tools"][0].update(server_url="http://10.1.2.3/t"),
     "method.reinforcement.tools[0].server_url"),
    (lambda b: b.update(training_file="file-nope"), "training_file"),
])
def test_the_jobs_checks_apply(api, change, param):
    body = diagnostic_body(api.upload_ok(question_rows()))
    change(body)
    response = api.post(BASE, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_invalid_file_fails_the_diagnostic(api):
    file_id = api.upload_ok(b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    diag_id = api.post(BASE, json=diagnostic_body(file_id)).json()["id"]
    failed = wait_for(lambda: (d := api.get(f"{BASE}/{diag_id}").json())["status"] == "failed" and d)
    assert failed["error"]["code"] == "invalid_json" and "line 2" in failed["error"]["message"]


def test_idempotency_and_project_scope(api, client, settings):
    file_id = api.upload_ok(question_rows())
    headers = {"Idempotency-Key": "diag-1"}
    first = api.post(BASE, json=diagnostic_body(file_id), headers=headers).json()
    again = api.post(BASE, json=diagnostic_body(file_id), headers=headers).json()
    assert first["id"] == again["id"]
    other = Api(client, make_project(settings)["key"])
    for method, path in (("GET", f"{BASE}/{first['id']}"), ("POST", f"{BASE}/{first['id']}/cancel"),
                         ("GET", f"{BASE}/{first['id']}/rollouts")):
        response = other.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "diagnostic_not_found"
    assert other.get(BASE).json()["data"] == []


def record(sample: int, run: int, reward: float | None, **extra: Any) -> dict[str, Any]:
    return {"trace_id": f"trace_{sample}_{run}", "sample_index": sample, "run_index": run, "reward": reward,
            "finish_reason": "answered", "tool_calls": [{"name": "search", "status": "ok", "turn": 1}],
            "completion_tokens": 7, "prompt_tokens": 30, "tool_output_tokens": 4, "wall_time_s": 0.2,
            "excluded": None, **extra}


BASIS = {"n_train": 3, "tool_max_concurrency": 16,
         "settings": [{"compute_multiplier": 1.0, "batch_size": 3, "group_size": 4, "configured": True}]}


def test_a_worker_runs_it_and_the_control_plane_judges(api, worker):
    diag = queued_diagnostic(api, rows=3, runs_per_sample=2)
    claimed = worker.call("POST", f"/diagnostics/{diag['id']}/claim", {"worker_id": "w1"})
    assert claimed.status_code == 200, claimed.text
    worker.lease_id = claimed.json()["lease_id"]
    spec = claimed.json()["diagnostic"]
    assert spec["runs_per_sample"] == 2 and spec["done_samples"] == [] and spec["non_read_only_tools"] == "call"
    assert spec["method"]["reinforcement"]["tools"][0]["headers"]["Authorization"].endswith("abcdef123456")
    assert api.get(f"{BASE}/{diag['id']}").json()["status"] == "running"
    assert worker.leased("POST", f"/diagnostics/{diag['id']}/heartbeat").json()["action"] == "continue"
    push = worker.leased("POST", f"/diagnostics/{diag['id']}/rollouts", samples_total=3, load_basis=BASIS,
                         records=[record(0, 0, 0.0), record(0, 1, 0.0), record(1, 0, 1.0)])
    assert push.json() == {"stored": 3, "samples_done": 1, "rollouts_done": 3}
    # A repeat (same trace) and a re-run of a stored (sample, run) are skipped.
    again = worker.leased("POST", f"/diagnostics/{diag['id']}/rollouts",
                          records=[record(1, 0, 1.0), {**record(0, 0, 1.0), "trace_id": "trace_other"},
                                   record(1, 1, 1.0), record(2, 0, 0.0), record(2, 1, 1.0)])
    assert again.json() == {"stored": 3, "samples_done": 3, "rollouts_done": 6}
    running = api.get(f"{BASE}/{diag['id']}").json()
    assert running["progress"]["samples_done"] == 3 and running["summary"] is None
    finished = worker.leased("POST", f"/diagnostics/{diag['id']}/finish", status="succeeded")
    assert finished.json() == {"status": "succeeded"}
    assert worker.leased("POST", f"/diagnostics/{diag['id']}/finish", status="succeeded").json()["status"] == "succeeded"

    done = api.get(f"{BASE}/{diag['id']}").json()
    assert done["status"] == "succeeded" and done["finished_at"]
    summary = done["summary"]
    assert (summary["share_always_0"], summary["share_always_1"], summary["share_mixed"]) == (1 / 3, 1 / 3, 1 / 3)
    assert [s["signal"] for s in done["samples"]] == ["always_0", "always_1", "mixed"]
    assert done["samples"][2]["scores"] == [0.0, 1.0] and done["samples"][2]["std"] == 0.5
    assert summary["load_projection"][0]["tools"]["search"]["calls_per_step"] == 12
    assert done["verdict"]["message"].startswith("33% of samples have signal")
    assert done["verdict"]["example_rollout_ids"] == ["trace_2_1", "trace_2_0"]

    page = api.get(f"{BASE}/{diag['id']}/rollouts", params={"limit": 4}).json()
    assert [(r["sample_index"], r["run_index"]) for r in page["data"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert page["has_more"] and page["data"][0]["object"] == "fine_tuning.diagnostic.rollout"
    assert page["data"][0]["tool_calls"] == 1 and page["data"][0]["data"]["completion_tokens"] == 7
    rest = api.get(f"{BASE}/{diag['id']}/rollouts", params={"after": page["last_id"]}).json()
    assert [(r["sample_index"], r["run_index"]) for r in rest["data"]] == [(2, 0), (2, 1)] and not rest["has_more"]
    one = api.get(f"{BASE}/{diag['id']}/rollouts", params={"sample_index": 2}).json()
    assert [r["id"] for r in one["data"]] == ["trace_2_0", "trace_2_1"]
    assert api.post(f"{BASE}/{diag['id']}/cancel").json()["error"]["code"] == "invalid_diagnostic_status"


def test_cancel_reaches_the_worker_and_keeps_partial_results(api, worker):
    diag = queued_diagnostic(api, rows=3, runs_per_sample=2)
    worker.lease_id = worker.call("POST", f"/diagnostics/{diag['id']}/claim", {"worker_id": "w1"}).json()["lease_id"]
    worker.leased("POST", f"/diagnostics/{diag['id']}/rollouts", records=[record(0, 0, 0.0), record(0, 1, 1.0)])
    cancelled = api.post(f"{BASE}/{diag['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["samples"][0]["signal"] == "mixed"
    assert worker.leased("POST", f"/diagnostics/{diag['id']}/heartbeat").json()["action"] == "cancel"
    assert worker.leased("POST", f"/diagnostics/{diag['id']}/finish", status="cancelled").json()["status"] == "cancelled"
    claim = worker.call("POST", f"/diagnostics/{diag['id']}/claim", {"worker_id": "w2"})
    assert claim.status_code == 409 and claim.json()["error"]["code"] == "not_claimable"


def test_a_silent_worker_loses_it_and_the_next_one_skips_stored_samples(api, worker, settings, client):
    diag = queued_diagnostic(api, rows=2, runs_per_sample=2)
    worker.lease_id = worker.call("POST", f"/diagnostics/{diag['id']}/claim", {"worker_id": "w1"}).json()["lease_id"]
    worker.leased("POST", f"/diagnostics/{diag['id']}/rollouts", records=[record(1, 0, 0.0), record(1, 1, 0.0)])
    app_state = client.app.state
    assert expire_leases(app_state.session_factory, app_state.queue) == []  # still live
    assert expire_leases(app_state.session_factory, app_state.queue,
                         now=utcnow() + timedelta(seconds=settings.lease_seconds + 1)) == [diag["id"]]
    assert api.get(f"{BASE}/{diag['id']}").json()["status"] == "queued"
    lost = worker.leased("POST", f"/diagnostics/{diag['id']}/heartbeat")
    assert lost.status_code == 409 and lost.json()["error"]["code"] == "lease_lost"
    second = Worker(client, settings.worker_token.get_secret_value(), "w2")
    claim = second.call("POST", f"/diagnostics/{diag['id']}/claim", {"worker_id": "w2"}).json()
    assert claim["diagnostic"]["done_samples"] == [1]


def test_worker_routes_need_the_worker_token(api, client):
    diag = queued_diagnostic(api)
    response = client.post(f"/internal/v1/diagnostics/{diag['id']}/claim", json={"worker_id": "w"},
                           headers=api.headers)
    assert response.status_code == 401


def test_a_jobs_diagnostic_is_created_once_and_recorded(api, worker, settings):
    file_id = api.upload_ok(question_rows())
    body = job_body(file_id, reinforcement={"x_open_model": {"diagnostic": {"runs_per_sample": 2,
                                                                            "drop_zero_signal": True}}})
    job = api.post("/v1/fine_tuning/jobs", json=body).json()
    assert job["method"]["reinforcement"]["x_open_model"]["diagnostic"] == {
        "runs_per_sample": 2, "max_samples": None, "non_read_only_tools": "call", "drop_zero_signal": True}
    wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "queued")
    assert worker.claim(job["id"]).status_code == 200
    first = worker.leased("POST", f"/jobs/{job['id']}/diagnostic").json()
    assert first["created"] and first["status"] == "queued"
    assert worker.leased("POST", f"/jobs/{job['id']}/diagnostic").json() == {**first, "created": False}
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["diagnostic_id"] == first["id"]
    diag = api.get(f"{BASE}/{first['id']}").json()
    assert diag["fine_tuning_job_id"] == job["id"] and diag["runs_per_sample"] == 2
    refused = api.post(f"{BASE}/{first['id']}/cancel")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "diagnostic_owned_by_job"
    # The job's diagnostic is never sent to the broker on its own; a job that ends takes it along.
    api.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    engine = make_engine(settings.resolved_database_url)
    try:
        expire_leases(make_session_factory(engine), None)
    finally:
        engine.dispose()
    assert api.get(f"{BASE}/{first['id']}").json()["status"] == "cancelled"


def test_job_diagnostic_options_are_checked(api):
    file_id = api.upload_ok(question_rows())
    body = job_body(file_id, reinforcement={"x_open_model": {"diagnostic": {"runs_per_sample": 1}}})
    response = api.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "method.reinforcement.x_open_model.diagnostic.runs_per_sample"


def test_client_functions_progress_bar_and_config_presets(settings, project, tmp_path):
    import openai
    import yaml

    from app import cli_client
    from tests.conftest import jsonl, live_server

    (tmp_path / "train.jsonl").write_bytes(jsonl(question_rows(2)))
    config = {**job_body("train.jsonl"), "suffix": "ignored", "validation_file": "not-uploaded.jsonl"}
    config["method"]["reinforcement"]["x_open_model"] = {"diagnostic": {"runs_per_sample": 5, "max_samples": 1}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    with live_server(settings) as base, openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"],
                                                      max_retries=0) as sdk:
        uploads: list[str] = []
        body = cli_client.diagnostic_body_from_config(sdk, tmp_path / "job.yaml", runs=None, max_samples=None,
                                                      echo=uploads.append)
        assert body["runs_per_sample"] == 5 and body["max_samples"] == 1 and body["training_file"].startswith("file-")
        assert "suffix" not in body and "validation_file" not in body and len(uploads) == 1
        again = cli_client.diagnostic_body_from_config(sdk, tmp_path / "job.yaml", runs=2, max_samples=None,
                                                       echo=uploads.append)
        assert again["runs_per_sample"] == 2
        created = cli_client.create_diagnostic(sdk, body)
        assert cli_client.cancel_diagnostic(sdk, created["id"])["status"] == "cancelled"
        final = cli_client._wait_with_bar(sdk, created["id"], 0.1)  # the live bar a terminal shows
        assert final["status"] == "cancelled"
        assert cli_client.format_diagnostic(final).startswith(f"diagnostic                       {created['id']}")
        with pytest.raises(cli_client.CliError, match=r"\(param: runs_per_sample\)"):
            cli_client.create_diagnostic(sdk, {**body, "runs_per_sample": 1})
        with pytest.raises(cli_client.CliError, match="diagnostic_not_found"):
            cli_client.retrieve_diagnostic(sdk, "diag-missing")
