"""The dashboard over HTTP, as a browser without JavaScript sees it: login and sessions, CSRF,
project scoping, the jobs list, the job page and its chart data, the job actions, the rollout
browser and transcripts. (tests/dashboard/test_browser.py drives a real Chromium.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from sqlalchemy import update

from app.auth.models import ApiKey
from app.core.db import make_engine, make_session_factory, utcnow
from app.dashboard.auth import COOKIE
from app.dashboard.charts import chart_specs, charted_keys
from app.dashboard.queries import FINISH_REASONS
from tests.conftest import Api, make_project, wait_for
from tests.dashboard.helpers import csrf_of, login, report_steps, report_supervised_steps
from tests.test_internal import Worker, queued_job, queued_supervised_job, supervised_metrics_data

APP_DIR = Path(__file__).resolve().parents[2] / "app" / "dashboard"


@pytest.fixture
def worker(client, settings) -> Worker:  # noqa: ANN001
    return Worker(client, settings.worker_token.get_secret_value())


@pytest.fixture
def running_job(api: Api, worker: Worker) -> str:
    job_id = queued_job(api)
    assert worker.claim(job_id).status_code == 200
    return job_id


def status(api: Api, job_id: str) -> str:
    return api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"]


# --- login, sessions, CSRF ----------------------------------------------------------------

def test_pages_need_a_login_and_the_data_answers_401(client, running_job):
    page = client.get(f"/dashboard/jobs/{running_job}/rollouts?step=1", follow_redirects=False)
    assert page.status_code == 303
    target = urlparse(page.headers["location"])
    assert target.path == "/dashboard/login"
    assert parse_qs(target.query)["next"] == [f"/dashboard/jobs/{running_job}/rollouts?step=1"]
    data = client.get(f"/dashboard/jobs/{running_job}/data")
    assert data.status_code == 401 and data.json()["error"]["code"] == "login_required"
    assert client.get("/dashboard/jobs/x/metrics.csv").status_code == 401


def test_login_sets_an_httponly_signed_cookie_without_the_key(client, project):
    form = client.get("/dashboard/login")
    assert form.status_code == 200 and 'for="api_key"' in form.text
    bad = client.post("/dashboard/login", data={"api_key": "sk-wrong", "csrf_token": csrf_of(form.text)})
    assert bad.status_code == 401 and "not valid" in bad.text
    response = client.post("/dashboard/login", data={"api_key": project["key"], "csrf_token": csrf_of(bad.text),
                                                     "next": "https://evil.example/steal"}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/dashboard/jobs"  # no open redirect
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=lax" in cookie
    assert "Path=/dashboard" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    assert project["key"] not in value and project["key"][3:20] not in value
    jobs = client.get("/dashboard/jobs")
    assert jobs.status_code == 200 and project["project_id"] in jobs.text
    assert "default-src 'self'" in jobs.headers["content-security-policy"]


def test_login_and_every_form_refuse_a_missing_or_foreign_csrf_token(client, project, running_job, api):
    assert client.post("/dashboard/login", data={"api_key": project["key"]}).status_code == 403
    before = csrf_of(client.get("/dashboard/login").text)
    csrf = login(client, project["key"])
    assert csrf != before  # the token changes at login
    assert client.get("/dashboard/login", follow_redirects=False).headers["location"] == "/dashboard/jobs"
    for data in ({}, {"csrf_token": "forged"}):
        response = client.post(f"/dashboard/jobs/{running_job}/pause", data=data, follow_redirects=False)
        assert response.status_code == 403
    assert status(api, running_job) == "running"
    assert client.post("/dashboard/logout", data={}).status_code == 403


def test_a_tampered_cookie_or_a_revoked_key_ends_the_session(client, project, settings):
    login(client, project["key"])
    assert client.get("/dashboard/jobs", follow_redirects=False).status_code == 200
    good = client.cookies.get(COOKIE)
    client.cookies.clear()
    client.cookies.set(COOKIE, good[:-3] + ("AAA" if not good.endswith("AAA") else "BBB"))
    assert client.get("/dashboard/jobs", follow_redirects=False).status_code == 303
    client.cookies.clear()
    client.cookies.set(COOKIE, good)
    assert client.get("/dashboard/jobs", follow_redirects=False).status_code == 200
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        session.execute(update(ApiKey).values(revoked_at=utcnow()))
    engine.dispose()
    assert client.get("/dashboard/jobs", follow_redirects=False).status_code == 303


def test_logout_clears_the_session(client, project):
    csrf = login(client, project["key"])
    response = client.post("/dashboard/logout", data={"csrf_token": csrf}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/dashboard/login"
    assert client.get("/dashboard/jobs", follow_redirects=False).status_code == 303


# --- scoping ----------------------------------------------------------------------------------

def test_another_projects_job_is_not_found_anywhere(client, settings, running_job):
    other = make_project(settings)
    csrf = login(client, other["key"])
    assert running_job not in client.get("/dashboard/jobs").text
    for path in ("", "/rollouts", "/rollouts/trace_s1_r0"):
        page = client.get(f"/dashboard/jobs/{running_job}{path}")
        assert page.status_code == 404 and "There is no job" in page.text
    assert client.get(f"/dashboard/jobs/{running_job}/data").status_code == 404
    assert client.get(f"/dashboard/jobs/{running_job}/metrics.csv").status_code == 404
    assert client.post(f"/dashboard/jobs/{running_job}/cancel", data={"csrf_token": csrf}).status_code == 404


def test_a_service_error_is_a_page_on_the_dashboard_and_stays_json_on_the_api(client, api, settings, running_job):
    """One APIError handler answers the dashboard's routes as they mean it (the
    not-found page, the poll's short JSON error) and leaves every other route the API's JSON."""
    other = make_project(settings)
    login(client, other["key"])
    page = client.get(f"/dashboard/jobs/{running_job}")
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert f"There is no job {running_job} in this project." in page.text
    diagnostic = client.get("/dashboard/diagnostics/vdiag_nope/rollouts")
    assert diagnostic.status_code == 404 and "There is no diagnostic vdiag_nope in this project." in diagnostic.text
    poll = client.get(f"/dashboard/jobs/{running_job}/data")
    assert poll.status_code == 404
    assert poll.json() == {"error": {"message": f"No such fine-tuning job: '{running_job}'",
                                     "code": "fine_tuning_job_not_found"}}
    # The same client, dashboard cookie and all, on the API: the OpenAI-shaped JSON error.
    from_api = client.get(f"/v1/fine_tuning/jobs/{running_job}", headers={"Authorization": f"Bearer {other['key']}"})
    assert from_api.status_code == 404 and from_api.headers["content-type"] == "application/json"
    assert from_api.json() == {"error": {"message": f"No such fine-tuning job: '{running_job}'",
                                         "type": "invalid_request_error", "param": "fine_tuning_job_id",
                                         "code": "fine_tuning_job_not_found"}}


# --- jobs list --------------------------------------------------------------------------------

def test_jobs_list_newest_first_filtered_by_status_and_paginated(client, api, project, worker):
    file_id = api.upload_ok([{"messages": [{"role": "user", "content": "hi"}], "reference_answer": "1"}])
    body = {"model": "tiny-smollm2", "training_file": file_id, "suffix": "mine",
            "method": {"type": "reinforcement", "reinforcement": {
                "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                           "reference": "{{item.reference_answer}}", "operation": "eq"}}}}
    ids = [api.post("/v1/fine_tuning/jobs", json=body).json()["id"] for _ in range(27)]
    for job_id in ids[:2]:
        wait_for(lambda job_id=job_id: status(api, job_id) == "queued")
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    login(client, project["key"])
    first = client.get("/dashboard/jobs").text
    assert "27 jobs" in first and "Page 1 of 2" in first and "mine" in first and "tiny-smollm2" in first
    shown = [line.split('data-job-id="')[1].split('"')[0] for line in first.splitlines() if 'data-job-id="' in line]
    assert shown == ids[::-1][:25]
    second = client.get("/dashboard/jobs?page=2").text
    assert [line.split('data-job-id="')[1].split('"')[0] for line in second.splitlines() if 'data-job-id="' in line] \
        == ids[::-1][25:]
    cancelled = client.get("/dashboard/jobs?status=cancelled").text
    assert "2 jobs with status cancelled" in cancelled and ids[0] in cancelled and ids[5] not in cancelled


def test_jobs_list_shows_progress_and_latest_rewards(client, api, project, running_job, worker):
    report_steps(worker, running_job, range(1, 4), total=10)
    login(client, project["key"])
    row = next(line for line in client.get("/dashboard/jobs").text.split("<tr ") if running_job in line)
    assert "3 / 10" in row and "0.300" in row and "0.100" in row  # step 3's train reward, step 2's valid reward


# --- job page and its data --------------------------------------------------------------------

def test_job_page_header_masks_tool_headers_and_summarises_the_grader(client, project, running_job):
    login(client, project["key"])
    page = client.get(f"/dashboard/jobs/{running_job}")
    assert page.status_code == 200
    assert "tool-secret-abcdef123456" not in page.text and "****3456" in page.text
    assert "string_check" in page.text and "http://127.0.0.1:8765/tools" in page.text
    assert 'id="action-pause"' in page.text and 'id="action-resume"' in page.text
    resume = page.text.split('id="action-resume"')[1].split(">")[0]
    assert "disabled" in resume  # a running job can be paused or cancelled, not resumed
    assert '<script src="/dashboard/vendor/plotly.min.js' in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text.split("<main")[0]


def test_chart_data_has_one_point_per_step_and_polls_return_only_new_steps(client, project, running_job, worker):
    report_steps(worker, running_job, range(1, 5), total=6)
    login(client, project["key"])
    data = client.get(f"/dashboard/jobs/{running_job}/data").json()
    series = data["series"]
    assert series["scores.train_reward_mean"]["x"] == [1, 2, 3, 4]
    assert series["scores.train_reward_mean"]["y"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert series["scores.valid_reward_mean"]["x"] == [2, 4]
    assert set(k for k in series if k.startswith("tools.tool_calls_per_rollout_by_tool.")) == {
        "tools.tool_calls_per_rollout_by_tool.search", "tools.tool_calls_per_rollout_by_tool.cat"}
    assert "timing.step.full_iteration" not in series and "timing.step.sampling" in series
    assert series["timing.breakdown.decode"]["y"] == pytest.approx([0.5] * 4)  # "Where a step's time goes"
    assert "usage.completion_tokens" not in series  # not charted, not sent
    assert data["job"]["step"] == 4 and data["job"]["total_steps"] == 6 and data["job"]["active"]
    assert data["job"]["actions"] == ["pause", "cancel"]
    assert any(e["message"].startswith("Step 4/6") for e in data["events"])

    report_steps(worker, running_job, range(5, 6), total=6)
    poll = client.get(f"/dashboard/jobs/{running_job}/data?after_step=4").json()
    assert poll["series"]["scores.train_reward_mean"]["x"] == [5]
    assert client.get(f"/dashboard/jobs/{running_job}/data?after_step=5").json()["series"] == {}


def test_metrics_csv_has_a_row_per_step(client, project, running_job, worker):
    report_steps(worker, running_job, range(1, 4), total=3)
    login(client, project["key"])
    response = client.get(f"/dashboard/jobs/{running_job}/metrics.csv")
    lines = response.text.strip().splitlines()
    assert response.headers["content-type"].startswith("text/csv")
    assert lines[0].startswith("step,") and "scores.train_reward_mean" in lines[0] and len(lines) == 4


def test_plotly_js_is_served_from_the_installed_package(client):
    response = client.get("/dashboard/vendor/plotly.min.js")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/javascript")
    assert response.content.startswith(b"/**\n* plotly.js v") and len(response.content) > 1_000_000
    assert "immutable" in response.headers["cache-control"]
    assert client.get("/dashboard/static/dashboard.js").status_code == 200


def test_chart_specs_draw_the_trainers_metric_keys():
    """The keys the charts draw are the ones the trainer reports: `tools.*` from the real
    summary of real rollout records, the rest named in workers/methods/reinforcement/step_report.py; so a renamed
    metric cannot leave a chart silently empty."""
    from app.dashboard.charts import charted_keys
    from app.jobs.worker_service import flatten_metrics
    from workers.engine.rollout import RolloutRecord, ToolCallRecord
    from workers.engine.summary import summarize

    call = ToolCallRecord(call_id="c1", name="search", arguments="{}", status="ok", status_code=200,
                          latency_s=0.1, bytes=3, error=None, concurrency=16)  # as the tool client records it
    tools = flatten_metrics({"tools": summarize([RolloutRecord(trace_id="t", sample_index=0, messages=[],
                                                               tool_calls=[call])])})
    trainer = (APP_DIR.parents[1] / "workers" / "methods" / "reinforcement" / "step_report.py").read_text()
    exact, prefixes, _ = charted_keys("reinforcement")
    for key in exact + prefixes:
        if key.startswith("tools."):
            assert any(k == key or (key.endswith(".") and k.startswith(key)) for k in tools), key
        else:
            assert f'"{key.rstrip(".").split(".")[-1]}"' in trainer, key


def test_supervised_charts_draw_the_supervised_trainers_metric_keys():
    """Every key a supervised chart draws is one the supervised trainer reports (its last step
    has them all), and a supervised job's page shows no reinforcement chart."""
    from app.jobs.worker_service import flatten_metrics

    reported = flatten_metrics(supervised_metrics_data(4, 4, eval_every=2))
    exact, prefixes, _ = charted_keys("supervised")
    assert exact and not prefixes and set(exact) <= set(reported)
    assert not {c["id"] for c in chart_specs("supervised")} & {c["id"] for c in chart_specs("reinforcement")}


def test_dpo_charts_draw_the_dpo_trainers_metric_keys():
    """Every key a DPO chart draws is one the DPO trainer reports at its last step, and each method
    draws its own charts."""
    from app.jobs.worker_service import flatten_metrics
    from workers.methods.dpo.loss import PairScores
    from workers.methods.dpo.trainer import step_metrics

    scores = PairScores(pairs=4, loss=2.4, correct=3, chosen_reward=0.2, rejected_reward=-0.4, logprob_margin=8.0,
                        learned_tokens=40, grad_norm=0.5)
    reported = flatten_metrics(step_metrics(4, 4, scores, scores, scores, learning_rate=5e-5, step_s=0.3))
    exact, prefixes, _ = charted_keys("dpo")
    assert exact and not prefixes and set(exact) <= set(reported)
    ids = {method: {c["id"] for c in chart_specs(method)} for method in ("reinforcement", "supervised", "dpo")}
    assert not ids["dpo"] & (ids["supervised"] | ids["reinforcement"]) and chart_specs("no-such-method") == []


def config_of(html: str) -> dict:
    return json.loads(re.search(r'id="dashboard-config">(.*?)</script>', html).group(1))


def test_a_supervised_jobs_page_shows_its_hyperparameters_and_loss_curves(client, api, project, worker):
    job_id = queued_supervised_job(api, hyperparameters={"n_epochs": 2},
                                   x_open_model={"lora_rank": 8, "max_seq_tokens": 1024})
    assert worker.claim(job_id).status_code == 200
    report_supervised_steps(worker, job_id, range(1, 5), total=4, eval_every=2)
    resolved = {"batch_size": 3, "n_epochs": 2, "learning_rate_multiplier": 1.0}
    assert worker.leased("POST", f"/jobs/{job_id}/state", completed_steps=4, resume_state="/ckpt/s4",
                         resolved_hyperparameters=resolved).status_code == 200
    login(client, project["key"])
    page = client.get(f"/dashboard/jobs/{job_id}").text

    for name, value in resolved.items():  # the worker's values, not "auto"
        assert f'<th scope="row">{name}</th><td>{value}</td>' in page
    assert '<th scope="row">x_open_model.lora_rank</th><td><code>8</code></td>' in page
    assert '<th scope="row">x_open_model.max_seq_tokens</th><td><code>1024</code></td>' in page
    assert '<th scope="row">x_open_model.training_mode</th><td><code>lora</code></td>' in page
    assert "<dt>Train loss (latest)</dt><dd data-field=\"train_loss\">0.250</dd>" in page
    assert "<dt>Valid loss (latest)</dt><dd data-field=\"valid_loss\">0.300</dd>" in page
    # What only a reinforcement job has is not on the page.
    for absent in ("Train reward", "max_episode_steps", 'id="tools-title"', 'id="grader-title"', "Browse rollouts",
                   'id="tool-mix-share"'):
        assert absent not in page, absent
    config = config_of(page)
    assert [c["id"] for c in config["charts"]] == ["sft-loss", "sft-accuracy", "sft-tokens", "sft-grad-norm",
                                                   "sft-step-time"]
    assert [h["field"] for h in config["headlines"]] == ["train_loss", "valid_loss"]
    checkpoints = page.split('id="checkpoints-table"')[1].split("</table>")[0]
    assert "Train loss</th>" in checkpoints and "the 3 latest are kept" in page
    assert "<td>4</td>" in checkpoints and '<td class="num">0.300</td>' in checkpoints  # step 4's valid loss

    data = client.get(f"/dashboard/jobs/{job_id}/data").json()
    series = data["series"]
    assert series["train_loss"]["x"] == [1, 2, 3, 4]
    assert series["train_loss"]["y"] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert series["valid_loss"] == {"x": [2, 4], "y": pytest.approx([0.6, 0.3])}
    assert series["full_valid_loss"] == {"x": [4], "y": pytest.approx([1.1 / 4])}
    assert series["train_mean_token_accuracy"]["y"] == pytest.approx([0.5, 0.75, 1 - 1 / 6, 0.875])
    assert series["valid_mean_token_accuracy"]["x"] == [2, 4]
    assert set(series) == set(charted_keys("supervised")[0])  # every chart has its data, nothing else is sent
    assert data["job"]["method"] == "supervised" and data["job"]["train_loss"] == pytest.approx(0.25)
    assert [(c["step"], c["valid_loss"]) for c in data["checkpoints"]] == [(4, pytest.approx(0.3)),
                                                                          (2, pytest.approx(0.6))]
    assert "Step 4/4: training loss=0.250, validation loss=0.300, full validation loss=0.275" in \
        [e["message"] for e in data["events"]]

    rollouts = client.get(f"/dashboard/jobs/{job_id}/rollouts")
    assert rollouts.status_code == 200 and "Rollouts do not apply to a supervised job" in rollouts.text
    assert "Apply filters" not in rollouts.text


def test_a_reinforcement_jobs_page_keeps_its_reward_panels(client, project, running_job):
    login(client, project["key"])
    page = client.get(f"/dashboard/jobs/{running_job}").text
    assert "<dt>Train reward (latest)</dt>" in page and "Browse rollouts" in page and 'id="tool-mix-share"' in page
    assert "max_episode_steps" in page and 'id="grader-title"' in page and "validation reward and the latest" in page
    assert [c["id"] for c in config_of(page)["charts"]] == [c["id"] for c in chart_specs("reinforcement")]


def test_finish_reasons_match_the_rollout_engine():
    from workers.engine.rollout import FINISH_REASONS as ENGINE_REASONS

    assert FINISH_REASONS == ENGINE_REASONS


# --- actions --------------------------------------------------------------------------------

def test_pause_resume_cancel_buttons_move_the_job_through_the_state_machine(client, api, project, running_job):
    csrf = login(client, project["key"])

    def act(action: str) -> str:
        response = client.post(f"/dashboard/jobs/{running_job}/{action}", data={"csrf_token": csrf},
                               follow_redirects=False)
        assert response.status_code == 303
        return response.headers["location"]

    assert act("pause").endswith("?notice=paused") and status(api, running_job) == "paused"
    page = client.get(f"/dashboard/jobs/{running_job}?notice=paused").text
    assert "Job paused." in page
    # Its worker still holds the lease (it has not stopped for the pause): it keeps the job.
    assert act("resume").endswith("?notice=resumed") and status(api, running_job) == "running"
    assert act("cancel").endswith("?notice=cancelled") and status(api, running_job) == "cancelled"
    assert act("pause").endswith("?notice=refused") and status(api, running_job) == "cancelled"
    events = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{running_job}/events?limit=50").json()["data"]]
    assert {"Job paused by user.", "Job cancelled by user."} <= set(events)
    assert any(e.startswith("Job resumed by user; worker") and e.endswith("keeps running it.") for e in events)
    assert client.post(f"/dashboard/jobs/{running_job}/explode", data={"csrf_token": csrf}).status_code == 404


# --- rollouts -------------------------------------------------------------------------------

def _trace_ids(html: str) -> list[str]:
    """The transcript links of a rollout-browser page, in order."""
    return re.findall(r'/rollouts/(trace_[A-Za-z0-9_]+)"', html)


def test_rollout_browser_filters(client, project, running_job, worker):
    report_steps(worker, running_job, range(1, 4), total=3)
    login(client, project["key"])
    base = f"/dashboard/jobs/{running_job}/rollouts"

    def ids(**params: str) -> list[str]:
        response = client.get(base, params=params)
        assert response.status_code == 200, response.text
        return _trace_ids(response.text)

    everything = ids()
    assert everything == [f"trace_s{s}_r{r}" for s in (3, 2, 1) for r in (0, 2, 1, 3)]  # newest step, then sample
    assert ids(step="2") == ["trace_s2_r0", "trace_s2_r2", "trace_s2_r1", "trace_s2_r3"]
    assert ids(sample="1", step="1") == ["trace_s1_r1", "trace_s1_r3"]
    assert ids(reward_min="0.4", reward_max="0.6") == ["trace_s3_r2", "trace_s2_r2", "trace_s1_r2"]
    assert ids(finish_reason="tool_budget", step="3") == ["trace_s3_r1"]
    assert ids(tool="cat", step="3") == ["trace_s3_r0", "trace_s3_r3"]
    assert ids(tool="search", step="3", reward_max="0.5") == ["trace_s3_r1"]
    assert ids(split="valid") == []
    # Empty fields are "any"; bad ones are reported on the page, not as a JSON error.
    assert ids(step="", reward_min="", tool="") == everything
    bad = client.get(base, params={"step": "two"})
    assert bad.status_code == 200 and "step must be a whole number" in bad.text


def test_rollout_browser_pages_with_a_cursor(client, project, running_job, worker, monkeypatch):
    from app.dashboard import queries

    monkeypatch.setattr(queries, "ROLLOUTS_PER_PAGE", 5)
    monkeypatch.setattr(queries.list_rollouts, "__defaults__", (5,))
    report_steps(worker, running_job, range(1, 4), total=3)
    login(client, project["key"])
    seen, url = [], f"/dashboard/jobs/{running_job}/rollouts"
    while url:
        page = client.get(url).text
        seen += _trace_ids(page)
        nxt = page.split('rel="next"')[0].rsplit('href="', 1)[-1].split('"')[0] if 'rel="next"' in page else None
        url = f"/dashboard/jobs/{running_job}/rollouts{nxt.replace('&amp;', '&')}" if nxt else None
    assert seen == [f"trace_s{s}_r{r}" for s in (3, 2, 1) for r in (0, 2, 1, 3)]


def test_an_unknown_cursor_lists_the_first_page_and_says_so(client, project, running_job, worker):
    report_steps(worker, running_job, range(1, 2), total=1)
    login(client, project["key"])
    page = client.get(f"/dashboard/jobs/{running_job}/rollouts", params={"after": "trace_nope"})
    assert page.status_code == 200 and "No rollout with id &#39;trace_nope&#39; to page after." in page.text
    assert _trace_ids(page.text) == [f"trace_s1_r{r}" for r in (0, 2, 1, 3)]


def test_transcript_shows_turns_tool_calls_grades_and_the_trace_id(client, project, running_job, worker):
    report_steps(worker, running_job, range(1, 2), total=1)
    login(client, project["key"])
    page = client.get(f"/dashboard/jobs/{running_job}/rollouts/trace_s1_r0")
    assert page.status_code == 200
    html = page.text
    assert '<code id="trace-id">trace_s1_r0</code>' in html
    from agent_rft.tracing import w3c_trace_id  # the traceparent its requests carried
    assert f"traceparent: 00-{w3c_trace_id('trace_s1_r0')}-&lt;span id&gt;-01" in html
    assert html.count('class="msg tool-call') == 2 and "assistant · turn 3" in html
    assert html.index("<strong class=\"tool-name\">search") < html.index("<strong class=\"tool-name\">cat")
    assert "output truncated" in html and "12 ms" in html and "result 0" in html
    assert "&#34;query&#34;: &#34;q0&#34;" in html  # pretty-printed arguments, escaped
    assert "1.0000" in html and "No grader errors." in html
    assert '<dd id="rollout-policy-versions">0, 0, 0</dd>' in html  # the version that sampled each turn
    failed = client.get(f"/dashboard/jobs/{running_job}/rollouts/trace_s1_r3").text
    assert "grader_server_error" in failed and "excluded: grader_failure" in failed
    assert client.get(f"/dashboard/jobs/{running_job}/rollouts/trace_nope").status_code == 404


def test_html_in_records_is_escaped(client, project, running_job, worker):
    from tests.dashboard.helpers import rollout

    record = rollout(1, 0, reward=1.0, finish="answered", tools=["search"], output="<script>alert(1)</script>")
    assert worker.leased("POST", f"/jobs/{running_job}/rollouts", step=1, split="train",
                         records=[record]).status_code == 200
    login(client, project["key"])
    html = client.get(f"/dashboard/jobs/{running_job}/rollouts/trace_s1_r0").text
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_static_assets_are_packaged():
    for name in ("static/dashboard.js", "static/dashboard.css", "templates/base.html", "templates/job.html"):
        assert (APP_DIR / name).is_file()


# --- variance reports -------------------------------------------------------------------------

def finished_diagnostic(api: Api, worker: Worker) -> str:
    """A diagnostic of 3 samples x 2 runs (always 0, mixed, always 1), reported through the
    diagnostics' worker API."""
    from tests.dashboard.helpers import rollout

    file_id = api.upload_ok([{"messages": [{"role": "user", "content": f"q{i}"}], "reference_answer": "1"}
                             for i in range(3)])
    body = {"model": "tiny-smollm2", "training_file": file_id, "runs_per_sample": 2,
            "method": {"type": "reinforcement", "reinforcement": {
                "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                           "reference": "{{item.reference_answer}}", "operation": "eq"}}}}
    created = api.post("/v1/fine_tuning/alpha/diagnostics", json=body)
    assert created.status_code == 200, created.text
    diagnostic_id = created.json()["id"]
    wait_for(lambda: api.get(f"/v1/fine_tuning/alpha/diagnostics/{diagnostic_id}").json()["status"] == "queued")
    claim = worker.call("POST", f"/diagnostics/{diagnostic_id}/claim", {"worker_id": worker.worker_id})
    assert claim.status_code == 200, claim.text
    lease = claim.json()["lease_id"]
    records = []
    for sample, scores in enumerate(([0.0, 0.0], [1.0, 0.0], [1.0, 1.0])):
        for run, score in enumerate(scores):
            record = rollout(0, sample * 2 + run, reward=score, finish="answered", tools=["search"])
            records.append({**record, "trace_id": f"trace_d{sample}_{run}", "sample_index": sample, "run_index": run})
    pushed = worker.call("POST", f"/diagnostics/{diagnostic_id}/rollouts",
                         {"lease_id": lease, "records": records, "samples_total": 3})
    assert pushed.status_code == 200, pushed.text
    finished = worker.call("POST", f"/diagnostics/{diagnostic_id}/finish", {"lease_id": lease, "status": "succeeded"})
    assert finished.status_code == 200, finished.text
    return diagnostic_id


def test_variance_report_lists_samples_sorted_by_class_and_opens_their_runs(client, api, project, worker, settings):
    diagnostic_id = finished_diagnostic(api, worker)
    login(client, project["key"])
    listing = client.get("/dashboard/diagnostics").text
    assert diagnostic_id in listing and "33%" in listing
    page = client.get(f"/dashboard/diagnostics/{diagnostic_id}")
    assert page.status_code == 200
    html = page.text
    assert 'id="verdict-message"' in html and "33% of samples have signal" in html
    order = re.findall(r'data-sample="(\d+)" data-signal="(\w+)"', html)
    assert order == [("0", "always_0"), ("1", "mixed"), ("2", "always_1")]  # sorted by mean
    data = client.get(f"/dashboard/diagnostics/{diagnostic_id}/data").json()
    assert [(s["sample_index"], s["mean"], s["scores"]) for s in data["samples"]] == [
        (0, 0.0, [0.0, 0.0]), (1, 0.5, [1.0, 0.0]), (2, 1.0, [1.0, 1.0])]
    assert data["active"] is False and set(data["colours"]) >= {"mixed", "always_0", "always_1"}
    runs = client.get(f"/dashboard/diagnostics/{diagnostic_id}/rollouts?sample=1").text
    assert _trace_ids(runs) == ["trace_d1_0", "trace_d1_1"] and "mixed (signal)" in runs
    transcript = client.get(f"/dashboard/diagnostics/{diagnostic_id}/rollouts/trace_d1_0")
    assert transcript.status_code == 200 and '<code id="trace-id">trace_d1_0</code>' in transcript.text
    assert "<dt>Run</dt><dd>1</dd>" in transcript.text

    other = make_project(settings)
    client.cookies.clear()
    login(client, other["key"])
    assert client.get(f"/dashboard/diagnostics/{diagnostic_id}").status_code == 404
    assert client.get(f"/dashboard/diagnostics/{diagnostic_id}/data").status_code == 404
    assert client.get(f"/dashboard/diagnostics/{diagnostic_id}/rollouts/trace_d1_0").status_code == 404
    assert diagnostic_id not in client.get("/dashboard/diagnostics").text


def test_numbers_beyond_an_integer_column_are_reported_not_a_500(client, project, running_job, worker):
    """The rollout filters and the chart poll with numbers PostgreSQL's INTEGER
    cannot hold; the page says what is wrong, the poll answers 400."""
    report_steps(worker, running_job, range(1, 2), total=1)
    login(client, project["key"])
    base = f"/dashboard/jobs/{running_job}/rollouts"
    for params in ({"step": "99999999999"}, {"sample": "2147483648"}, {"step": "1", "sample": str(10**30)}):
        page = client.get(base, params=params)
        assert page.status_code == 200, (params, page.text[:300])
        assert "must be between 0 and 2,147,483,647" in page.text
    assert client.get(base, params={"step": "2147483647"}).status_code == 200
    poll = client.get(f"/dashboard/jobs/{running_job}/data", params={"after_step": "99999999999"})
    assert poll.status_code == 400 and poll.json()["error"]["param"] == "after_step"
    assert client.get(f"/dashboard/jobs/{running_job}/data", params={"after_step": "2147483647"}).status_code == 200
