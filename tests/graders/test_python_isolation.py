"""The python grader's isolation level: which sandbox a machine allows is reported, and python
graders are refused (400 at the API, not run by a worker) below the deployment's minimum.

A machine without namespaces is simulated with the isolation cap, which only ever lowers what the
probe may pick: these tests run the real probe and the real sandbox."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from app.core.config import Settings
from agent_rft.graders.core import GraderContext, Sample, grade
from agent_rft.graders.isolation import STRONGEST, PythonIsolation
from agent_rft.graders.sandbox import python_isolation
from agent_rft.graders.schemas import Grader
from app.main import create_app
from tests.conftest import Api, job_body, question_rows

AUDIT_HOOK = PythonIsolation.AUDIT_HOOK
PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 0.5\n"}
NESTED = {"type": "multi", "name": "both", "calculate_output": "exact + py", "graders": {
    "exact": {"type": "string_check", "name": "x", "input": "{{sample.output_text}}", "reference": "a",
              "operation": "eq"},
    "py": PYTHON}}


@contextmanager
def api_with(settings: Settings, project: dict[str, str], **update: Any) -> Iterator[Api]:
    """The real app with these settings changed, bound to the project's key."""
    with TestClient(create_app(settings.model_copy(update=update))) as client:
        yield Api(client, project["key"])


def assert_isolation_refused(response: Any, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("python_grader_isolation", param)
    # What is in force, what is required, and which setting changes it.
    for words in ("'audit_hook'", "'root_netns'", "AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION=audit_hook"):
        assert words in error["message"], error["message"]


# --- the setting and the probe ----------------------------------------------------------------


def test_the_required_isolation_is_the_audit_hook_only_with_the_embedded_default(tmp_path, monkeypatch) -> None:
    for name in ("DATABASE_URL", "BROKER_URL", "PYTHON_GRADER_MIN_ISOLATION"):
        monkeypatch.delenv(f"AGENT_RFT_{name}", raising=False)
    embedded = Settings(_env_file=None, data_dir=tmp_path)
    assert embedded.python_grader_required_isolation == AUDIT_HOOK
    postgres = Settings(_env_file=None, data_dir=tmp_path, database_url="postgresql://db/x")
    assert postgres.python_grader_required_isolation == PythonIsolation.ROOT_NETNS
    redis_broker = Settings(_env_file=None, data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/0")
    assert redis_broker.python_grader_required_isolation == PythonIsolation.ROOT_NETNS  # a worker elsewhere
    monkeypatch.setenv("AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION", "uid_drop_netns")
    assert Settings(_env_file=None, data_dir=tmp_path).python_grader_required_isolation == STRONGEST
    monkeypatch.setenv("AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION", "nothing")
    with pytest.raises(ValueError, match="python_grader_min_isolation"):
        Settings(_env_file=None, data_dir=tmp_path)


def test_the_cap_lowers_the_isolation_and_never_raises_it() -> None:
    machine = python_isolation()
    assert python_isolation(AUDIT_HOOK) == AUDIT_HOOK
    assert python_isolation(STRONGEST) == machine
    for cap in PythonIsolation:
        assert python_isolation(cap).rank <= min(cap.rank, machine.rank)


def test_a_worker_below_the_required_isolation_does_not_run_the_grader() -> None:
    """Fail closed: the sandbox refuses before starting the grader's process."""
    source = "def grade(sample, item):\n    return 1.0\n"
    config = TypeAdapter(Grader).validate_python({"type": "python", "name": "py", "source": source})

    def run(**isolation: Any):  # noqa: ANN202
        ctx = GraderContext(python_memory_mb=256, **isolation)
        return asyncio.run(grade(config, Sample.from_model_sample("x"), {}, ctx))

    refused = run(python_min_isolation=PythonIsolation.ROOT_NETNS, python_isolation_cap=AUDIT_HOOK)
    assert refused.reward == 0.0 and refused.errors["python_grader_server_error"] is True
    assert "'audit_hook'" in refused.errors["python_grader_server_error_type"]
    assert "AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION" in refused.errors["python_grader_server_error_type"]
    accepted = run(python_min_isolation=AUDIT_HOOK, python_isolation_cap=AUDIT_HOOK)
    assert accepted.reward == 1.0 and not accepted.failed
    machine = run(python_min_isolation=python_isolation())  # what this machine allows is enough
    assert machine.reward == 1.0 and not machine.failed


# --- the API ----------------------------------------------------------------------------------


def test_python_graders_are_refused_below_the_required_isolation(settings, project) -> None:  # noqa: ANN001
    """Outside the embedded default (here PostgreSQL and Redis) a machine without namespaces,
    simulated by the cap, may not run python graders: validate, run and job creation say why."""
    with api_with(settings, project, python_grader_isolation_cap=AUDIT_HOOK) as api:
        validate, run = "/v1/fine_tuning/alpha/graders/validate", "/v1/fine_tuning/alpha/graders/run"
        assert_isolation_refused(api.post(validate, json={"grader": PYTHON}), "grader")
        assert_isolation_refused(api.post(validate, json={"grader": NESTED}), "grader.graders.py")
        assert_isolation_refused(api.post(run, json={"grader": NESTED, "model_sample": "a"}), "grader.graders.py")
        other = NESTED["graders"]["exact"]
        assert api.post(validate, json={"grader": other}).status_code == 200  # no python grader: no refusal
        body = job_body(api.upload_ok(question_rows()), reinforcement={"grader": NESTED})
        created = api.post("/v1/fine_tuning/jobs", json=body)
        assert_isolation_refused(created, "method.reinforcement.grader.graders.py")


def test_the_setting_accepts_the_audit_hook_and_run_reports_the_isolation(settings, project) -> None:  # noqa: ANN001
    with api_with(settings, project, python_grader_isolation_cap=AUDIT_HOOK,
                  python_grader_min_isolation=AUDIT_HOOK) as api:
        ran = api.post("/v1/fine_tuning/alpha/graders/run", json={"grader": NESTED, "model_sample": "a"})
        assert ran.status_code == 200, ran.text
        assert ran.json()["reward"] == 1.5
        assert ran.json()["metadata"]["python_grader_isolation"] == "audit_hook"
        assert api.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": PYTHON}).status_code == 200
    machine = python_isolation()
    with api_with(settings, project, python_grader_min_isolation=machine) as api:  # no cap: the real probe
        ran = api.post("/v1/fine_tuning/alpha/graders/run", json={"grader": PYTHON, "model_sample": "a"})
        assert ran.json()["metadata"]["python_grader_isolation"] == machine
