"""A job end to end: the openai SDK creates it, a real Celery worker (a subprocess on Redis)
trains the tiny model against a real tool server, reporting over the internal API."""

from __future__ import annotations

import io
import os
import signal
import sys
import tarfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import psycopg

from app.core.config import Settings
from tests.conftest import agent_rft_worker, free_port, jsonl, live_server, wait_for
from tests.rl.tool_server import tool_server

AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


def rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What was ACME's revenue in {2000 + i}?"}],
             "tools": [SEARCH], "reference_answer": f"ACME revenue {2000 + i} was {100 + i} million"}
            for i in range(n)]


@pytest.fixture
def training_settings(settings: Settings, tmp_path: Path) -> Settings:
    settings.lease_seconds = 4
    settings.watchdog_interval_s = 0.5
    settings.checkpoint_dir = tmp_path / "checkpoints"
    settings.worker_token = type(settings.worker_token)("e2e-worker-token")
    return settings


def celery_worker(settings: Settings, api_url: str, extra_env: dict[str, str] | None = None):  # noqa: ANN201
    return agent_rft_worker(settings, api_url, token="e2e-worker-token", queues=settings.training_queue,
                            extra_env=extra_env)


def create_job(sdk: openai.OpenAI, tool_url: str, *, n_rows: int = 4, grader: dict | None = None,
               x_open_model: dict | None = None, integrations: list[dict] | None = None,
               **hyper) -> str:  # noqa: ANN003
    uploaded = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(rows(n_rows)))), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(
        model="tiny-smollm2", training_file=uploaded.id, seed=7,
        **({"integrations": integrations} if integrations else {}),
        method={"type": "reinforcement", "reinforcement": {
            "grader": grader or {"type": "text_similarity", "name": "similar", "input": "{{sample.output_text}}",
                                 "reference": "{{item.reference_answer}}", "evaluation_metric": "fuzzy_match"},
            "tools": [{"name": "search", "server_url": tool_url}],
            "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 1, "eval_interval": 1,
                                "eval_samples": 2, **hyper},
            "max_episode_steps": 2,
            "x_open_model": {"lora_rank": 4, "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24,
                             **(x_open_model or {})},
        }},
    )
    return job.id


def status_of(sdk: openai.OpenAI, job_id: str) -> str:
    return sdk.fine_tuning.jobs.retrieve(job_id).status


def test_a_job_trains_end_to_end(training_settings, project, pg_url):
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        job_id = create_job(sdk, tool_url)
        statuses = []

        def finished() -> bool:
            statuses.append(status_of(sdk, job_id))
            return statuses[-1] in ("succeeded", "failed", "cancelled")

        wait_for(finished, timeout=240, interval=0.5)
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
        assert "running" in statuses
        assert job.fine_tuned_model == f"ft:tiny-smollm2:{project['name']}::{job_id}"
        assert job.hyperparameters.batch_size == 2 and job.trained_tokens and job.trained_tokens > 0

        events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
        metrics = [e for e in events if e.type == "metrics"]
        assert sorted(e.data["step"] for e in metrics) == [1, 2]
        data = metrics[0].data
        assert {"step", "total_steps", "scores", "usage", "errors", "timing", "tools", "train"} <= set(data)
        assert "train_reward_mean" in data["scores"] and "full_iteration" in data["timing"]["step"]
        assert "tool_calls_per_rollout" in data["tools"] and "loss" in data["train"]

        rollouts = sdk.get(f"/fine_tuning/jobs/{job_id}/rollouts", cast_to=object, options={"params": {"limit": 100}})
        train = [r for r in rollouts["data"] if r["split"] == "train"]
        assert len(train) == 2 * 2 * 2  # steps x batch x group
        assert len({r["id"] for r in rollouts["data"]}) == len(rollouts["data"])

        checkpoints = list(sdk.fine_tuning.jobs.checkpoints.list(job_id))
        assert checkpoints and checkpoints[0].fine_tuned_model_checkpoint.startswith(f"ft:tiny-smollm2:{project['name']}")
        with psycopg.connect(pg_url) as conn:
            path = conn.execute("SELECT path FROM checkpoints WHERE id = %s", (checkpoints[0].id,)).fetchone()[0]
            steps = conn.execute("SELECT step FROM job_steps WHERE job_id = %s ORDER BY step", (job_id,)).fetchall()
        assert [s for (s,) in steps] == [1, 2]

        # The results file (one CSV row per step) and the trainer's checkpoint, downloaded.
        results = sdk.files.content(job.result_files[0]).text.splitlines()
        assert results[0].startswith("step,") and "scores.train_reward_mean" in results[0].split(",")
        assert [r.split(",")[0] for r in results[1:]] == ["1", "2"]
        archive = sdk.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{checkpoints[0].id}/content", cast_to=httpx.Response)
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            tar.extractall(training_settings.data_dir / "download", filter="data")
        folder = training_settings.data_dir / "download" / f"{job_id}-step-{checkpoints[0].step_number}"
        assert sorted(p.name for p in folder.iterdir()) == sorted({p.name for p in Path(path).iterdir()} | {"README.md"})
    from peft import PeftModel

    from workers.models.loading import load_model

    base_model = load_model("tiny-smollm2").model
    trained = PeftModel.from_pretrained(base_model, str(folder))
    assert trained is not None and any("lora" in name for name, _ in trained.named_parameters())


def test_cancel_stops_the_worker(training_settings, project):
    # A lease that outlasts a heartbeat delayed by a busy machine: with the file's 4 s leases, the
    # watchdog could clear the cancelled job's lease first, and the worker then stops without reporting.
    training_settings.lease_seconds = 15
    with live_server(training_settings) as base, tool_server(latency_s=0.3) as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        job_id = create_job(sdk, tool_url, n_rows=8, n_epochs=5)
        wait_for(lambda: status_of(sdk, job_id) == "running", timeout=120, interval=0.3)
        sdk.fine_tuning.jobs.cancel(job_id)
        try:
            wait_for(lambda: "Worker stopped" in " ".join(e.message for e in sdk.fine_tuning.jobs.list_events(job_id)),
                     timeout=90, interval=0.5)
        except AssertionError:
            raise AssertionError(f"no 'Worker stopped' event; the worker's log ends:\n{log.read_text()[-3000:]}") from None
        assert status_of(sdk, job_id) == "cancelled"


def test_a_failing_grader_server_fails_the_job_cleanly(training_settings, project):
    """Every grading goes to a port nobody listens on: retried, then failed; the job ends
    `failed` with the reason (a failing tool server is covered the same way in
    tests/rl/test_trainer.py, with a policy that is sure to call it)."""
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (worker, log):
        job_id = create_job(sdk, tool_url, n_rows=2,
                            grader={"type": "endpoint", "name": "remote", "url": "http://127.0.0.1:9/grade"})
        wait_for(lambda: status_of(sdk, job_id) in ("failed", "succeeded"), timeout=240, interval=0.5)
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        assert job.status == "failed" and job.error.code == "grader_failure_rate", (job.error, log.read_text()[-2000:])
        assert "127.0.0.1:9" in job.error.message or "grad" in job.error.message
        errors = [e for e in sdk.fine_tuning.jobs.list_events(job_id, limit=100) if e.level == "error"]
        assert errors and errors[0].message
        assert worker.poll() is None  # the worker survives a failed job


def test_a_killed_worker_is_replaced_and_no_step_is_lost_or_counted_twice(training_settings, project, pg_url):
    """SIGKILL mid-step while the next step is sampled ahead (max_staleness 1): the job resumes from
    its last saved step on another worker and every step is reported once, sampled at most one
    policy version behind its update. (Synchronous steps resume the same way: tests/rl/test_trainer.py.)"""
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        with celery_worker(training_settings, base) as (worker, _):
            job_id = create_job(sdk, tool_url, n_rows=6, n_epochs=2, eval_interval=1, x_open_model={"max_staleness": 1})
            # Mid-step, no goodbye: the step's rollouts are reported, its training state not yet saved.
            wait_for(lambda: unsaved_steps(pg_url, job_id), timeout=180, interval=0.01)
            os.killpg(worker.pid, signal.SIGKILL)
        assert status_of(sdk, job_id) == "running"
        # The watchdog notices the silent lease and re-queues the job from its last saved step.
        wait_for(lambda: status_of(sdk, job_id) == "queued", timeout=60, interval=0.3)
        with celery_worker(training_settings, base) as (_, log):
            wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed"), timeout=240, interval=0.5)
            assert status_of(sdk, job_id) == "succeeded", log.read_text()[-3000:]
        total = sdk.fine_tuning.jobs.retrieve(job_id).method.reinforcement.hyperparameters
        events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
        assert any("stopped sending heartbeats" in e.message for e in events)
        metric_steps = sorted(e.data["step"] for e in events if e.type == "metrics")
        assert metric_steps == list(range(1, len(metric_steps) + 1)) == steps_of(pg_url, job_id)
        assert metric_steps[-1] == events[[e.type for e in events].index("metrics")].data["total_steps"]
        assert total is not None
        assert_each_step_once(sdk, pg_url, job_id)
        lags = [e.data["train"]["staleness_max"] for e in events if e.type == "metrics"]
        assert all(lag in (0, 1) for lag in lags) and 1 in lags, lags


def unsaved_steps(pg: str | psycopg.Connection, job_id: str) -> list[int]:
    """Steps whose rollouts are stored past the job's saved training state. `pg` is a URL, or an
    open autocommit connection for a test that polls fast (a step's unsaved window can be short)."""
    if isinstance(pg, str):
        with psycopg.connect(pg) as conn:
            return unsaved_steps(conn, job_id)
    return [s for (s,) in pg.execute("SELECT DISTINCT r.step FROM job_rollouts r JOIN jobs j ON j.id = r.job_id "
                                     "WHERE r.job_id = %s AND r.step > j.completed_steps", (job_id,))]


def assert_each_step_once(sdk: openai.OpenAI, pg_url: str, job_id: str) -> None:
    """Every step's metrics once, and exactly batch_size x group_size training rollouts per step
    (2 x 2 here), in the API's listing and in its per-step filter, however often the job resumed."""
    events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
    metric_steps = sorted(e.data["step"] for e in events if e.type == "metrics")
    assert metric_steps == list(range(1, len(metric_steps) + 1)) == steps_of(pg_url, job_id)
    listed = sdk.get(f"/fine_tuning/jobs/{job_id}/rollouts", cast_to=object,
                     options={"params": {"limit": 100, "split": "train"}})["data"]
    per_step = {step: sum(1 for r in listed if r["step"] == step) for step in metric_steps}
    assert per_step == {step: 2 * 2 for step in metric_steps}, per_step
    for step in metric_steps:
        page = sdk.get(f"/fine_tuning/jobs/{job_id}/rollouts", cast_to=object,
                       options={"params": {"step": step, "split": "train"}})["data"]
        assert len(page) == 2 * 2, (step, len(page))


@pytest.mark.parametrize(("lease_s", "outage_s", "resumed"), [
    (30, 10, False),  # shorter than the lease: the worker waits it out and goes on
    (4, 10, True),    # longer: the worker gives the job back; it resumes from its last saved step
])
def test_an_api_restart_never_fails_a_running_job(training_settings, project, pg_url, lease_s, outage_s, resumed):
    """A deploy of the API: stopped after step 1 and started again `outage_s` later at the same
    address. The job succeeds either way, each step's metrics and rollouts exactly once."""
    training_settings.lease_seconds = lease_s
    port = free_port()
    with tool_server() as (tool_url, _), celery_worker(training_settings, f"http://127.0.0.1:{port}") as (_, log):
        with live_server(training_settings, port=port) as base, \
                openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
            job_id = create_job(sdk, tool_url, n_rows=6, n_epochs=1)
            wait_for(lambda: steps_of(pg_url, job_id), timeout=180, interval=0.1)
        time.sleep(outage_s)
        with live_server(training_settings, port=port) as base, \
                openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
            wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed", "cancelled"), timeout=240, interval=0.5)
            job = sdk.fine_tuning.jobs.retrieve(job_id)
            assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
            requeued = [e.message for e in sdk.fine_tuning.jobs.list_events(job_id, limit=100)
                        if "stopped sending heartbeats" in e.message]
            assert bool(requeued) == resumed, requeued
            assert_each_step_once(sdk, pg_url, job_id)


def steps_of(pg_url: str, job_id: str) -> list[int]:
    with psycopg.connect(pg_url) as conn:
        return [s for (s,) in conn.execute("SELECT step FROM job_steps WHERE job_id = %s ORDER BY step", (job_id,))]


def test_pause_and_resume_keep_one_worker_on_the_job_and_count_each_step_once(training_settings, project, pg_url):
    """Two workers on the queue. A pause and a resume within one heartbeat leave the job with its
    worker (no second run beside it); a pause the worker acknowledged, then a resume, hand it to the
    next claim from the saved state. Each step is trained and counted once."""
    # Leases that outlast a heartbeat delayed by a busy machine: with the file's 4 s leases the
    # watchdog could re-queue the job from under its live worker, and a third or fourth start follows.
    training_settings.lease_seconds = 15
    with live_server(training_settings) as base, tool_server(latency_s=0.2) as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log), celery_worker(training_settings, base) as (_, other_log):
        job_id = create_job(sdk, tool_url, n_rows=6, n_epochs=2, eval_interval=3)
        wait_for(lambda: steps_of(pg_url, job_id), timeout=180, interval=0.2)
        sdk.fine_tuning.jobs.pause(job_id)
        sdk.fine_tuning.jobs.resume(job_id)
        wait_for(lambda: len(steps_of(pg_url, job_id)) >= 3, timeout=180, interval=0.2)
        sdk.fine_tuning.jobs.pause(job_id)
        wait_for(lambda: "job paused" in " ".join(e.message for e in sdk.fine_tuning.jobs.list_events(job_id)),
                 timeout=90, interval=0.3)
        paused_at = steps_of(pg_url, job_id)
        time.sleep(1.5)
        assert steps_of(pg_url, job_id) == paused_at and status_of(sdk, job_id) == "paused"
        sdk.fine_tuning.jobs.resume(job_id)
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed"), timeout=240, interval=0.5)
        assert status_of(sdk, job_id) == "succeeded", (log.read_text()[-3000:], other_log.read_text()[-3000:])
        assert len(steps_of(pg_url, job_id)) > len(paused_at)
        assert_each_step_once(sdk, pg_url, job_id)
        messages = [e.message for e in sdk.fine_tuning.jobs.list_events(job_id, limit=100)]
    starts = [m for m in messages if m.startswith("Job started on worker")]
    history = "\n".join(reversed(messages))  # every event, oldest first: pytest would cut a list's repr short
    assert not [m for m in messages if "takes over" in m], history
    if any(m.endswith("keeps running it.") for m in messages):  # the quick pause never reached the worker
        assert len(starts) == 2, history
    else:  # rare: a heartbeat fell between the two calls; the worker stopped and the job was re-queued
        assert any("stopped for a pause that was withdrawn" in m for m in messages) and len(starts) == 3, history
