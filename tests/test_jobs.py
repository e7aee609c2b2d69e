"""/v1/fine_tuning/jobs: creation and its synchronous checks, listing, actions, events, checkpoints."""

import copy

import pytest

from app.core.crypto import secret_box
from app.core.db import make_engine, make_session_factory
from app.jobs import service
from app.jobs.models import Job
from tests.conftest import job_body, question_rows


def create(api, body, **kw):  # noqa: ANN001, ANN201
    return api.post("/v1/fine_tuning/jobs", json=body, **kw)


def test_create_returns_an_openai_job_and_queues_it(api):
    file_id = api.upload_ok(question_rows())
    response = create(api, job_body(file_id, seed=7, suffix="fin", metadata={"team": "research"}))
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["id"].startswith("ftjob-") and job["object"] == "fine_tuning.job"
    assert job["status"] == "validating_files" and job["seed"] == 7 and job["metadata"] == {"team": "research"}
    assert job["training_file"] == file_id and job["model"] == "SmolLM2-135M-Instruct"
    rl = job["method"]["reinforcement"]
    assert job["method"]["type"] == "reinforcement"
    assert rl["max_episode_steps"] == 10
    assert rl["hyperparameters"]["batch_size"] == "auto" and rl["hyperparameters"]["compute_multiplier"] == "auto"
    # The extension object comes back with every default filled in.
    assert rl["x_open_model"] == {"training_mode": "lora", "lora_rank": 16, "lora_alpha": 32, "loss": "grpo",
                                  "kl_coef": 0.0, "clip_epsilon": 0.2, "learning_rate": None, "max_tokens_per_turn": 256,
                                  "max_tokens_per_rollout": 2048, "temperature": 1.0, "top_p": 1.0,
                                  "dtype": "auto", "diagnostic": None, "rollout_timeout": None,
                                  "sampler": "auto", "importance_sampling_cap": None,
                                  "training_processes": None, "max_staleness": 0, "refill_zero_spread": False}
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "queued"


def test_tool_headers_are_stored_but_never_returned(api, settings):
    file_id = api.upload_ok(question_rows())
    job = create(api, job_body(file_id)).json()
    secret = "Bearer tool-secret-abcdef123456"
    for shown in (job, api.get(f"/v1/fine_tuning/jobs/{job['id']}").json(), api.get("/v1/fine_tuning/jobs").json()):
        assert secret not in str(shown) and "tool-secret" not in str(shown)
    assert job["method"]["reinforcement"]["tools"][0]["headers"] == {"Authorization": "****3456"}
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as session:  # the worker will need the real value: sealed, not hashed
        stored = session.query(Job).one().method["reinforcement"]["tools"][0]["headers"]["Authorization"]
    engine.dispose()
    assert stored["mask"] == "****3456" and "tool-secret" not in stored["sealed"]
    assert secret_box(settings).open(stored["sealed"]) == secret  # tests/test_secrets_at_rest.py: the rest


def test_tool_timeouts_retries_and_the_rollout_deadline_are_bounded(api):
    """Per-tool `timeout` (at most OpenAI's 10 minutes) and `retries`, and x_open_model.rollout_timeout."""
    file_id = api.upload_ok(question_rows())
    body = job_body(file_id)
    rl = body["method"]["reinforcement"]
    rl["tools"][0].update(timeout=600, retries=0)
    rl["x_open_model"] = {"rollout_timeout": 90}
    job = create(api, body).json()
    assert job["method"]["reinforcement"]["tools"][0]["timeout"] == 600
    assert job["method"]["reinforcement"]["tools"][0]["retries"] == 0
    assert job["method"]["reinforcement"]["x_open_model"]["rollout_timeout"] == 90
    for tool_fields, extension, param in (({"timeout": 600.5}, {}, "method.reinforcement.tools[0].timeout"),
                                          ({"timeout": 0}, {}, "method.reinforcement.tools[0].timeout"),
                                          ({"retries": 11}, {}, "method.reinforcement.tools[0].retries"),
                                          ({}, {"rollout_timeout": 0}, "method.reinforcement.x_open_model.rollout_timeout")):
        bad = job_body(file_id)
        bad["method"]["reinforcement"]["tools"][0].update(tool_fields)
        bad["method"]["reinforcement"]["x_open_model"] = extension
        error = create(api, bad).json()["error"]
        assert error["param"] == param, error


def test_explicit_hyperparameters_and_extension(api):
    file_id = api.upload_ok(question_rows())
    hp = {"batch_size": 8, "n_epochs": 2, "learning_rate_multiplier": 0.5, "compute_multiplier": 2,
          "eval_interval": 5, "eval_samples": 4, "reasoning_effort": "low"}
    ext = {"training_mode": "full", "loss": "dr_grpo", "kl_coef": 0.05, "temperature": 0.7, "dtype": "bfloat16"}
    job = create(api, job_body(file_id, reinforcement={"hyperparameters": hp, "x_open_model": ext,
                                                       "max_episode_steps": 4})).json()
    rl = job["method"]["reinforcement"]
    assert rl["hyperparameters"] == {**hp, "compute_multiplier": 2.0, "learning_rate_multiplier": 0.5}
    assert rl["x_open_model"]["training_mode"] == "full" and rl["x_open_model"]["loss"] == "dr_grpo"
    assert rl["x_open_model"]["dtype"] == "bfloat16"
    assert rl["max_episode_steps"] == 4
    assert job["hyperparameters"] == {"batch_size": 8, "learning_rate_multiplier": 0.5, "n_epochs": 2}


BAD_BODIES = [
    # (change to the body, expected param)
    (lambda b: b["method"]["reinforcement"]["hyperparameters"].update(batch_size=0),
     "method.reinforcement.hyperparameters.batch_size"),
    (lambda b: b["method"]["reinforcement"]["hyperparameters"].update(n_epochs=1.5),
     "method.reinforcement.hyperparameters.n_epochs"),
    (lambda b: b["method"]["reinforcement"]["hyperparameters"].update(learning_rate_multiplier=0),
     "method.reinforcement.hyperparameters.learning_rate_multiplier"),
    (lambda b: b["method"]["reinforcement"]["hyperparameters"].update(compute_multiplier="lots"),
     "method.reinforcement.hyperparameters.compute_multiplier"),
    (lambda b: b["method"]["reinforcement"]["hyperparameters"].update(eval_samples=-1),
     "method.reinforcement.hyperparameters.eval_samples"),
    (lambda b: b["method"]["reinforcement"]["hyperparameters"].update(warmup=3),
     "method.reinforcement.hyperparameters.warmup"),
    (lambda b: b["method"]["reinforcement"].update(max_episode_steps=0), "method.reinforcement.max_episode_steps"),
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(loss="ppo"), "method.reinforcement.x_open_model.loss"),
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(temperature=3), "method.reinforcement.x_open_model.temperature"),
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(learning_rate=0), "method.reinforcement.x_open_model.learning_rate"),
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(dtype="float16"), "method.reinforcement.x_open_model.dtype"),
    (lambda b: b["method"]["reinforcement"].pop("grader"), "method.reinforcement.grader"),
    (lambda b: b["method"]["reinforcement"]["grader"].update(type="magic"), "method.reinforcement.grader"),
    (lambda b: b["method"]["reinforcement"]["grader"].update(operation="contains"), "method.reinforcement.grader.operation"),
    (lambda b: b["method"]["reinforcement"]["grader"].pop("reference"), "method.reinforcement.grader.reference"),
    (lambda b: b["method"]["reinforcement"].update(grader={"type": "python", "name": "p", "source": "def grad(:"}),
     "method.reinforcement.grader.source"),
    (lambda b: b["method"]["reinforcement"].update(grader={
        "type": "multi", "name": "m", "calculate_output": "a + __import__('os')",
        "graders": {"a": {"type": "string_check", "name": "a", "input": "x", "reference": "y", "operation": "eq"}}}),
     "method.reinforcement.grader.calculate_output"),
    (lambda b: b["method"]["reinforcement"].update(grader={
        "type": "label_model", "name": "l", "model": "m", "input": [{"role": "user", "content": "x"}],
        "labels": ["a"], "passing_labels": ["b"]}), "method.reinforcement.grader.passing_labels"),
    (lambda b: b["method"]["reinforcement"]["tools"].append(dict(b["method"]["reinforcement"]["tools"][0])),
     "method.reinforcement.tools[1].name"),
    (lambda b: b["method"]["reinforcement"]["tools"][0].update(name="bad name!"), "method.reinforcement.tools[0].name"),
    (lambda b: b["method"]["reinforcement"]["tools"][0].update(server_url="ftp://x/y"),
     "method.reinforcement.tools[0].server_url"),
    (lambda b: b["method"]["reinforcement"]["tools"][0].pop("server_url"), "method.reinforcement.tools[0].server_url"),
    (lambda b: b["method"]["reinforcement"]["tools"][0].update(parameters={"type": "object", "properties": 3}),
     "method.reinforcement.tools[0].parameters"),
    (lambda b: b["method"]["reinforcement"]["tools"][0].update(parameters={"type": "string"}),
     "method.reinforcement.tools[0].parameters"),
    (lambda b: b["method"]["reinforcement"].update(response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                               "schema": {"type": "string", "pattern": "(unclosed"}}}),
     "method.reinforcement.response_format"),
    (lambda b: b["method"]["reinforcement"].update(response_format={"type": "json_schema", "json_schema": {}}),
     "method.reinforcement.response_format"),
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(max_staleness=2),
     "method.reinforcement.x_open_model.max_staleness"),  # one step of lag at most
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(max_staleness=-1),
     "method.reinforcement.x_open_model.max_staleness"),
    (lambda b: b["method"]["reinforcement"]["x_open_model"].update(refill_zero_spread="often"),
     "method.reinforcement.x_open_model.refill_zero_spread"),
    (lambda b: b.update(training_file="file-doesnotexist"), "training_file"),
    (lambda b: b.update(validation_file="file-doesnotexist"), "validation_file"),
    (lambda b: b.pop("model"), "model"),
    (lambda b: b["method"].update(type="dpo"), "method.reinforcement"),  # a block of another method than the type
    (lambda b: b["method"].update(type="distillation"), "method.type"),
    (lambda b: b.update(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    (lambda b: b.update(seed="abc"), "seed"),
]


@pytest.mark.parametrize("change,param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_job_requests_get_400_naming_the_field(api, change, param):
    file_id = api.upload_ok(question_rows())
    body = job_body(file_id, reinforcement={"hyperparameters": {}, "x_open_model": {}})
    body = copy.deepcopy(body)
    change(body)
    response = create(api, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert api.get("/v1/fine_tuning/jobs").json()["data"] == []  # nothing half-created


def test_a_strict_json_schema_response_format_is_kept_on_the_job(api):
    file_id = api.upload_ok(question_rows())
    answer_format = {"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True,
        "schema": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                   "required": ["answer"], "additionalProperties": False}}}
    job = create(api, job_body(file_id, reinforcement={"response_format": answer_format})).json()
    assert job["method"]["reinforcement"]["response_format"] == answer_format
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["method"]["reinforcement"]["response_format"] == answer_format


def test_a_method_no_one_registered_is_refused_clearly(api):
    file_id = api.upload_ok(question_rows())
    response = create(api, {"model": "m", "training_file": file_id, "method": {"type": "ppo", "ppo": {}}})
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_method"
    assert response.json()["error"]["param"] == "method.type"
    for method in ("'reinforcement'", "'supervised'", "'dpo'"):
        assert method in response.json()["error"]["message"]


def test_ssrf_guard_on_tool_and_grader_urls(client, app, project):
    from tests.conftest import Api

    app.state.settings.outbound_allowlist = []
    api = Api(client, project["key"])
    file_id = api.upload_ok(question_rows())
    for url in ("http://127.0.0.1:8765/tools", "http://localhost/x", "http://169.254.169.254/latest/meta-data",
                "http://10.1.2.3/", "http://[::1]:80/"):
        body = job_body(file_id)
        body["method"]["reinforcement"]["tools"][0]["server_url"] = url
        response = create(api, body)
        assert response.status_code == 400, url
        assert response.json()["error"]["code"] == "url_not_allowed"
        assert "AGENT_RFT_OUTBOUND_ALLOWLIST" in response.json()["error"]["message"]
    body = job_body(file_id)
    body["method"]["reinforcement"]["tools"] = []
    body["method"]["reinforcement"]["grader"] = {"type": "endpoint", "name": "e", "url": "http://127.0.0.1:9/grade"}
    assert create(api, body).json()["error"]["param"] == "method.reinforcement.grader.url"
    nested = {"type": "multi", "name": "m", "calculate_output": "0.5 * exact + 0.5 * judge", "graders": {
        "exact": {"type": "string_check", "name": "x", "input": "a", "reference": "b", "operation": "eq"},
        "judge": {"type": "endpoint", "name": "j", "url": "http://169.254.169.254/latest"}}}
    body["method"]["reinforcement"]["grader"] = nested
    refused = create(api, body).json()["error"]
    assert refused["param"] == "method.reinforcement.grader.graders.judge.url" and refused["code"] == "url_not_allowed"
    nested["graders"]["judge"]["url"] = "http://127.0.0.1:9/grade"
    app.state.settings.outbound_allowlist = ["127.0.0.0/8"]
    assert create(api, body).status_code == 200


def test_list_filters_by_metadata_and_pages(api):
    file_id = api.upload_ok(question_rows())
    ids = [create(api, job_body(file_id, metadata={"team": "a" if i % 2 else "b", "n": str(i)})).json()["id"]
           for i in range(5)]
    page1 = api.get("/v1/fine_tuning/jobs", params={"limit": 2}).json()
    assert page1["object"] == "list" and page1["has_more"] is True
    assert [j["id"] for j in page1["data"]] == [ids[4], ids[3]]
    page2 = api.get("/v1/fine_tuning/jobs", params={"limit": 2, "after": ids[3]}).json()
    assert [j["id"] for j in page2["data"]] == [ids[2], ids[1]]
    team_a = api.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a"}).json()["data"]
    assert [j["id"] for j in team_a] == [ids[3], ids[1]]
    both = api.get("/v1/fine_tuning/jobs", params={"metadata[team]": "b", "metadata[n]": "2"}).json()["data"]
    assert [j["id"] for j in both] == [ids[2]]
    assert api.get("/v1/fine_tuning/jobs", params={"metadata[team]": "zzz"}).json()["data"] == []
    assert api.get("/v1/fine_tuning/jobs", params={"limit": 101}).status_code == 400


def test_pause_resume_cancel_and_illegal_transitions(api):
    file_id = api.upload_ok(question_rows())
    job_id = create(api, job_body(file_id)).json()["id"]
    url = f"/v1/fine_tuning/jobs/{job_id}"
    assert api.get(url).json()["status"] == "queued"

    conflict = api.post(f"{url}/resume")
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "invalid_job_status"
    assert "'queued'" in conflict.json()["error"]["message"]

    assert api.post(f"{url}/pause").json()["status"] == "paused"
    assert api.post(f"{url}/pause").status_code == 409
    assert api.post(f"{url}/resume").json()["status"] == "queued"
    cancelled = api.post(f"{url}/cancel").json()
    assert cancelled["status"] == "cancelled" and isinstance(cancelled["finished_at"], int)
    for action in ("pause", "resume", "cancel"):
        again = api.post(f"{url}/{action}")
        assert again.status_code == 409 and "'cancelled'" in again.json()["error"]["message"]
    missing = api.post("/v1/fine_tuning/jobs/ftjob-nope/cancel")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "fine_tuning_job_not_found"

    # Every transition wrote an event; newest first.
    messages = [e["message"] for e in api.get(f"{url}/events", params={"limit": 100}).json()["data"]]
    assert messages[0] == "Job cancelled by user."
    statuses = [e["data"]["status"] for e in api.get(f"{url}/events", params={"limit": 100}).json()["data"][::-1]
                if e["data"] and "previous_status" in e["data"]]
    assert statuses == ["queued", "paused", "queued", "cancelled"]


def test_state_machine_is_the_only_way_to_change_status():
    from app.jobs.state import TERMINAL, TRANSITIONS

    assert not (set(TRANSITIONS) & TERMINAL)  # nothing leaves a terminal status
    import pathlib
    import re

    # One state machine (app/core/lifecycle.StateMachine.move) writes every job's and diagnostic's status.
    writers = [p for p in pathlib.Path("app").rglob("*.py") if re.search(r"\.status\s*=\s*[^=]", p.read_text())]
    assert writers == [pathlib.Path("app/core/lifecycle.py")]


def test_events_paginate_with_after(api):
    file_id = api.upload_ok(question_rows())
    job_id = create(api, job_body(file_id)).json()["id"]
    url = f"/v1/fine_tuning/jobs/{job_id}/events"
    everything = api.get(url, params={"limit": 100}).json()["data"]
    assert len(everything) >= 4
    assert all(e["object"] == "fine_tuning.job.event" and e["id"].startswith("ftevent-") for e in everything)
    first = api.get(url, params={"limit": 2}).json()
    assert first["has_more"] is True and first["data"] == everything[:2]
    rest = api.get(url, params={"limit": 100, "after": first["data"][-1]["id"]}).json()
    assert rest["data"] == everything[2:] and rest["has_more"] is False


def test_checkpoints_listed_newest_first(api, settings):
    file_id = api.upload_ok(question_rows())
    job_id = create(api, job_body(file_id)).json()["id"]
    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints"
    assert api.get(url).json()["data"] == []
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        job = session.query(Job).one()
        for step in (2, 4, 6):
            service.record_checkpoint(session=session, job=job, step_number=step, model_ref=f"{job_id}:ckpt-step-{step}",
                                      metrics={"valid_reward_mean": step / 10})
    engine.dispose()
    data = api.get(url, params={"limit": 2}).json()
    assert [c["step_number"] for c in data["data"]] == [6, 4] and data["has_more"] is True
    checkpoint = data["data"][0]
    assert checkpoint["id"].startswith("ftckpt_") and checkpoint["object"] == "fine_tuning.job.checkpoint"
    assert checkpoint["fine_tuning_job_id"] == job_id and checkpoint["metrics"] == {"valid_reward_mean": 0.6}


def test_idempotent_job_creation(api):
    file_id = api.upload_ok(question_rows())
    body = job_body(file_id)
    first = create(api, body, headers={"Idempotency-Key": "job-key-1"})
    replay = create(api, body, headers={"Idempotency-Key": "job-key-1"})
    assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]
    changed = create(api, job_body(file_id, seed=3), headers={"Idempotency-Key": "job-key-1"})
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "idempotency_key_reused"
    # The same key on another endpoint is a different request too.
    assert api.upload(question_rows(), headers={"Idempotency-Key": "job-key-1"}).status_code == 409
    assert len(api.get("/v1/fine_tuning/jobs").json()["data"]) == 1
    assert create(api, body, headers={"Idempotency-Key": "job-key-2"}).json()["id"] != first.json()["id"]


def test_concurrent_requests_with_one_idempotency_key_create_one_job(api, client):
    from concurrent.futures import ThreadPoolExecutor

    file_id = api.upload_ok(question_rows())
    body = job_body(file_id)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: create(api, body, headers={"Idempotency-Key": "race"}), range(8)))
    assert {r.status_code for r in responses} == {200}
    assert len({r.json()["id"] for r in responses}) == 1
    assert len(api.get("/v1/fine_tuning/jobs").json()["data"]) == 1
