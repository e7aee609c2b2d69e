"""A job on 2 training processes (docs/scaling.md), end to end: the openai SDK creates it, a real
Celery worker runs rank 0 and spawns rank 1 (gloo, on the CPU); both sample and train a share of
every step. A SIGKILL of rank 1 mid-job is noticed, named in an event, and the job resumes from its
last saved step, no step lost or counted twice."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import psycopg
import pytest

from app.core.config import Settings
from tests.conftest import live_server, wait_for
from tests.rl.tool_server import tool_server
from tests.test_training_e2e import (  # noqa: F401 - training_settings is a fixture
    assert_each_step_once,
    celery_worker,
    create_job,
    status_of,
    steps_of,
    training_settings,
    unsaved_steps,
)

@pytest.fixture
def two_process_settings(training_settings: Settings) -> Settings:
    training_settings.training_processes = 2
    return training_settings


def followers_of(pid: int) -> list[int]:
    """The worker's spawned training processes (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(stat[1]) == pid and "spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def events_of(sdk: openai.OpenAI, job_id: str) -> list:
    return list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))


def test_a_job_trains_on_two_processes(two_process_settings, project, pg_url):
    with live_server(two_process_settings) as base, tool_server() as (tool_url, recorder), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(two_process_settings, base) as (worker, log):
        job_id = create_job(sdk, tool_url, x_open_model={"training_processes": 3})
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed", "cancelled"), timeout=300, interval=0.5)
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
        assert not followers_of(worker.pid)  # rank 1 ended with the job
        events = events_of(sdk, job_id)
        assert any(e.level == "warn" and "asks for 3 training processes" in e.message for e in events)
        started = [e for e in events if "Training on 2 processes" in e.message]
        assert started and started[0].data["backend"] == "gloo"
        assert_each_step_once(sdk, pg_url, job_id)
        assert list(sdk.fine_tuning.jobs.checkpoints.list(job_id))


def test_a_killed_follower_is_named_and_the_job_resumes_from_its_last_saved_step(two_process_settings, project,
                                                                                 pg_url):
    with live_server(two_process_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(two_process_settings, base) as (worker, log):
        job_id = create_job(sdk, tool_url, n_rows=6, n_epochs=2, eval_interval=1)
        # Mid-step: the step's rollouts are reported, its training state not yet saved. That window
        # can be a few milliseconds on a busy machine: find rank 1 first, then poll one open
        # connection, nothing slower.
        (follower,) = wait_for(lambda: followers_of(worker.pid), timeout=180, interval=0.05)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            wait_for(lambda: unsaved_steps(conn, job_id), timeout=180, interval=0.001)
        os.kill(follower, signal.SIGKILL)
        wait_for(lambda: any("rank 1" in e.message for e in events_of(sdk, job_id)), timeout=120, interval=0.3)
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed"), timeout=300, interval=0.5)
        assert status_of(sdk, job_id) == "succeeded", log.read_text()[-3000:]
        lost = [e for e in events_of(sdk, job_id) if "rank 1" in e.message]
        assert lost[0].level == "error" and "SIGKILL" in lost[0].message
        assert "resumes from its last saved step" in lost[0].message and lost[0].data["rank"] == 1
        assert sum("Training on 2 processes" in e.message for e in events_of(sdk, job_id)) == 2  # started again
        assert_each_step_once(sdk, pg_url, job_id)


def test_a_state_saved_by_two_processes_resumes_on_one(two_process_settings, project, pg_url):
    # Leases long enough that a heartbeat delayed by a loaded machine does not hand the job to a
    # new claim mid-test: this test is about the saved state, not about a lost worker.
    two_process_settings.lease_seconds = 15
    with live_server(two_process_settings) as base, tool_server(latency_s=0.2) as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        with celery_worker(two_process_settings, base) as (_, log):
            job_id = create_job(sdk, tool_url, n_rows=6, n_epochs=2, eval_interval=3)
            wait_for(lambda: steps_of(pg_url, job_id), timeout=180, interval=0.2)
            sdk.fine_tuning.jobs.pause(job_id)
            wait_for(lambda: status_of(sdk, job_id) == "paused", timeout=90, interval=0.3)
        paused_at = steps_of(pg_url, job_id)
        two_process_settings.training_processes = 1
        with celery_worker(two_process_settings, base) as (_, log):
            sdk.fine_tuning.jobs.resume(job_id)
            wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed"), timeout=240, interval=0.5)
            assert status_of(sdk, job_id) == "succeeded", log.read_text()[-3000:]
        events = events_of(sdk, job_id)
        assert sum("Training on 2 processes" in e.message for e in events) == 1  # the resumed run: one process
        assert any(f"Resumed training at step {paused_at[-1]}" in e.message for e in events), \
            (paused_at, [e.message for e in events])
        assert_each_step_once(sdk, pg_url, job_id)
