"""The Weights & Biases integration (`integrations: [{"type": "wandb", ...}]`), as the openai SDK
sends it: checked at creation, shown on the job, the project's W&B key sealed and never echoed,
and a real worker logging every step of a real job to an offline W&B run (no network) that is
read back from disk."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest

from app.auth.service import set_integration_key
from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.db import make_engine, make_session_factory
from tests.conftest import jsonl, live_server, wait_for
from tests.rl.tool_server import tool_server
from tests.test_training_e2e import AGENT_RFT, celery_worker, create_job, rows, status_of, training_settings  # noqa: F401

WANDB_KEY = "wandb-test-key-0123456789abcdef0123456789abcdef"


def wandb(project: str = "agent-rft-tests", **options: Any) -> dict[str, Any]:
    return {"type": "wandb", "wandb": {"project": project, **options}}


def set_key(settings: Settings, project_name: str, key: str = WANDB_KEY) -> None:
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine).begin() as session:
            set_integration_key(session=session, project_name=project_name, integration="wandb", key=key,
                                box=secret_box(settings))
    finally:
        engine.dispose()


def upload(sdk: openai.OpenAI) -> str:
    return sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(rows(2)))), purpose="fine-tune").id


def create(sdk: openai.OpenAI, training_file: str, integrations: list[dict[str, Any]]) -> Any:
    return sdk.fine_tuning.jobs.create(
        model="tiny-smollm2", training_file=training_file, integrations=integrations,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}})


def refused(sdk: openai.OpenAI, training_file: str, integrations: list[dict[str, Any]]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        create(sdk, training_file, integrations)
    return caught.value


# --- creation: OpenAI's limits, the project's key -------------------------------------------

def test_integrations_are_checked_at_creation(settings, project):
    with live_server(settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        file_id = upload(sdk)
        missing = refused(sdk, file_id, [wandb()])
        assert (missing.status_code, missing.code, missing.param) == (400, "wandb_api_key_missing", "integrations")
        assert "agent-rft projects set-wandb-key" in missing.message

        set_key(settings, project["name"])
        too_many = refused(sdk, file_id, [wandb()] * 6)
        assert (too_many.status_code, too_many.param) == (400, "integrations") and "at most 5" in too_many.message
        long_tag = refused(sdk, file_id, [wandb(tags=["ok", "x" * 65])])
        assert (long_tag.status_code, long_tag.param) == (400, "integrations[0].wandb.tags[1]")
        assert "64" in long_tag.message
        many_tags = refused(sdk, file_id, [wandb(tags=[f"t{i}" for i in range(51)])])
        assert many_tags.param == "integrations[0].wandb.tags" and "at most 50" in many_tags.message
        assert refused(sdk, file_id, [wandb(), wandb("other")]).param == "integrations[1]"
        assert refused(sdk, file_id, [{"type": "slack", "slack": {}}]).param.startswith("integrations[0]")
        assert refused(sdk, file_id, [{"type": "wandb", "wandb": {}}]).param == "integrations[0].wandb.project"
        assert refused(sdk, file_id, [wandb(api_key=WANDB_KEY)]).param == "integrations[0].wandb.api_key"

        job = create(sdk, file_id, [wandb(name="run-1", entity="acme", tags=["a", "b" * 64])])
        expected = [{"type": "wandb", "wandb": {"project": "agent-rft-tests", "name": "run-1", "entity": "acme",
                                                 "tags": ["a", "b" * 64]}}]
        assert [i.model_dump() for i in job.integrations] == expected  # the SDK's FineTuningJobWandbIntegrationObject
        assert [i.model_dump() for i in sdk.fine_tuning.jobs.retrieve(job.id).integrations] == expected
        assert create(sdk, file_id, []).integrations is None


def test_the_key_is_sealed_and_never_shown(settings, project, pg_url):
    set_key(settings, project["name"])
    with live_server(settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        job = create(sdk, upload(sdk), [wandb()])
        answers = [sdk.fine_tuning.jobs.retrieve(job.id), *sdk.fine_tuning.jobs.list(),
                   *sdk.fine_tuning.jobs.list_events(job.id)]
        assert all(WANDB_KEY not in a.model_dump_json() for a in answers)
    with psycopg.connect(pg_url) as conn:
        stored = conn.execute("SELECT sealed FROM integration_secrets WHERE project_id = %s AND integration = 'wandb'",
                              (project["project_id"],)).fetchone()[0]
    assert stored.startswith("fernet:") and WANDB_KEY not in stored


def test_the_cli_sets_and_clears_the_key(settings, project, pg_url):
    env = {**os.environ, "AGENT_RFT_DATABASE_URL": pg_url, "AGENT_RFT_DATA_DIR": str(settings.data_dir)}

    def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([AGENT_RFT, "projects", "set-wandb-key", *args], input=stdin, env=env,
                              capture_output=True, text=True, timeout=120)

    def stored() -> str | None:
        with psycopg.connect(pg_url) as conn:
            row = conn.execute("SELECT sealed FROM integration_secrets WHERE project_id = %s AND integration = 'wandb'",
                               (project["project_id"],)).fetchone()
            return row[0] if row else None

    done = cli(project["name"], "--key-stdin", stdin=WANDB_KEY + "\n")
    assert done.returncode == 0, done.stderr
    assert WANDB_KEY not in done.stdout + done.stderr and stored().startswith("fernet:")
    assert secret_box(settings).open(stored()) == WANDB_KEY

    unknown = cli("no-such-project", "--key-stdin", stdin=WANDB_KEY)
    assert unknown.returncode == 1 and "No project named 'no-such-project'" in unknown.stderr
    blank = cli(project["name"], "--key-stdin", stdin="  \n")
    assert blank.returncode == 1 and "W&B key" in blank.stderr

    cleared = cli(project["name"], "--clear")
    assert cleared.returncode == 0 and stored() is None


# --- the worker side, without a worker ----------------------------------------------------

def claimed_job(**overrides: Any) -> Any:
    from app.jobs.worker_schemas import ClaimedJob

    return ClaimedJob.model_validate({
        "id": "ftjob-abc", "project_id": "proj_1", "project_name": "p", "model": "tiny-smollm2",
        "training_file": "file-1", "validation_file": None, "seed": 7, "suffix": None, "resume_state": None,
        "completed_steps": 0, "resolved_hyperparameters": None, "integrations": [wandb(tags=["x"])],
        "integration_keys": {"wandb": WANDB_KEY},
        "method": {"type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "name": "g", "input": "a", "reference": "a", "operation": "eq"},
            "tools": [{"name": "search", "server_url": "http://127.0.0.1:1/t",
                       "headers": {"Authorization": "Bearer tool-secret-abcdef123456"}}]}},
        **overrides})


def test_metrics_are_flattened_with_their_event_names():
    from workers.integrations.wandb_run import flat_metrics

    data = {"step": 3, "total_steps": 4, "scores": {"train_reward_mean": 0.5}, "usage": {},
            "tools": {"by_tool": {"search": 1.5}}, "train": {"loss": 0.1, "ok": True, "nan": float("nan")},
            "note": "text"}
    assert flat_metrics(data) == {"total_steps": 4, "scores/train_reward_mean": 0.5,
                                  "tools/by_tool/search": 1.5, "train/loss": 0.1}


def test_the_run_config_masks_header_values():
    from workers.integrations.wandb_run import run_config

    config = run_config(claimed_job(), {"batch_size": 2})
    assert config["hyperparameters"] == {"batch_size": 2} and config["seed"] == 7
    assert "tool-secret" not in json.dumps(config) and WANDB_KEY not in json.dumps(config)


def test_a_wandb_failure_warns_once_and_never_raises(monkeypatch):
    import sys
    import types

    from workers.integrations.wandb_run import wandb_run

    def broken_init(**kwargs: Any) -> Any:
        raise ConnectionError(f"no network for key {kwargs['settings'].api_key}")

    fake = types.SimpleNamespace(init=broken_init, Settings=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    warnings: list[str] = []
    run = wandb_run(claimed_job(), lambda message, data: warnings.append(message))
    for step in (1, 2, 3):
        run.log_step(step, {"scores": {"train_reward_mean": 0.5}}, None)
    run.finish("succeeded")
    assert len(warnings) == 1 and "ConnectionError" in warnings[0] and "training goes on" in warnings[0]
    assert WANDB_KEY not in warnings[0]
    assert wandb_run(claimed_job(integrations=[]), warnings.append) is None


# --- a real job logged to an offline W&B run -------------------------------------------------

def offline_runs(wandb_dir: Path, run_id: str) -> list[Path]:
    """The `.wandb` files of the run's offline directories, oldest first (one per claim)."""
    return sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"), key=lambda p: p.parent.name)


LOG_BLOCK, LOG_HEADER = 32768, 7  # the `.wandb` file: LevelDB's log format (crc32, length, type) of protobufs


def log_chunks(path: Path) -> Any:
    """The payloads of a `.wandb` file's records. wandb ships no reader of its own in this version."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = LOG_HEADER, b""
    while pos + LOG_HEADER <= len(data):
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < LOG_HEADER:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + LOG_HEADER:pos + LOG_HEADER + length], pos + LOG_HEADER + length
        if kind == 0:
            return
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            yield pending


def records(path: Path) -> list[Any]:
    """Every record of an offline run's transaction log, as wandb wrote it."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for chunk in log_chunks(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        found.append(record)
    return found


def read_run(path: Path) -> dict[str, Any]:
    """The run record, its config, every logged step's values and the exit code of one offline run."""
    run, config, history, exit_code = None, {}, {}, None
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            values = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            history[values.pop("_step", record.history.step.num)] = values
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"run": run, "config": config, "history": history, "exit_code": exit_code}


def test_a_job_logs_every_step_to_its_wandb_run(training_settings, project, tmp_path):
    wandb_dir = tmp_path / "wandb-runs"
    wandb_dir.mkdir()
    set_key(training_settings, project["name"])
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base, extra_env=env) as (_, log):
        job_id = create_job(sdk, tool_url, integrations=[wandb(name="e2e", tags=["agent-rft", "e2e"])])
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed", "cancelled"), timeout=240, interval=0.5)
        job = sdk.fine_tuning.jobs.retrieve(job_id)
        assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
        assert job.integrations[0].wandb.tags == ["agent-rft", "e2e"]
        events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
        answers = [job.model_dump_json(), *(e.model_dump_json() for e in events)]
        worker_log = log.read_text()

    assert not [e.message for e in events if "Weights & Biases" in e.message], worker_log[-3000:]
    assert all(WANDB_KEY not in answer for answer in answers) and WANDB_KEY not in worker_log
    for written in wandb_dir.rglob("*"):  # wandb's own files never hold the key either
        assert not written.is_file() or WANDB_KEY.encode() not in written.read_bytes(), written

    paths = offline_runs(wandb_dir, job_id)
    assert len(paths) == 1, list(wandb_dir.rglob("*"))
    logged = read_run(paths[0])
    run = logged["run"]
    assert run.run_id == job_id and run.project == "agent-rft-tests" and run.display_name == "e2e"
    assert list(run.tags) == ["agent-rft", "e2e"]
    config = logged["config"]
    assert config["model"] == "tiny-smollm2" and config["seed"] == 7 and config["training_file"] == job.training_file
    assert config["hyperparameters"]["batch_size"] == 2 and config["hyperparameters"]["n_epochs"] == 1
    assert config["method"]["type"] == "reinforcement"
    assert logged["exit_code"] == 0

    metrics = {e.data["step"]: e.data for e in events if e.type == "metrics"}
    assert sorted(logged["history"]) == sorted(metrics) == [1, 2]
    for step, data in metrics.items():
        values = logged["history"][step]
        assert values["scores/train_reward_mean"] == pytest.approx(data["scores"]["train_reward_mean"])
        assert values["train/loss"] == pytest.approx(data["train"]["loss"])
        assert values["tools/tool_calls_per_rollout"] == pytest.approx(data["tools"]["tool_calls_per_rollout"])


def test_a_paused_and_resumed_job_continues_the_same_run(training_settings, project, pg_url, tmp_path):
    from tests.test_training_e2e import steps_of

    wandb_dir = tmp_path / "wandb-runs"
    wandb_dir.mkdir()
    set_key(training_settings, project["name"])
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    with live_server(training_settings) as base, tool_server(latency_s=0.2) as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base, extra_env=env) as (_, log):
        job_id = create_job(sdk, tool_url, n_rows=6, n_epochs=2, eval_interval=3, integrations=[wandb()])
        wait_for(lambda: steps_of(pg_url, job_id), timeout=180, interval=0.2)
        sdk.fine_tuning.jobs.pause(job_id)
        wait_for(lambda: "job paused" in " ".join(e.message for e in sdk.fine_tuning.jobs.list_events(job_id)),
                 timeout=90, interval=0.3)
        sdk.fine_tuning.jobs.resume(job_id)
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed"), timeout=240, interval=0.5)
        assert status_of(sdk, job_id) == "succeeded", log.read_text()[-3000:]
        steps = steps_of(pg_url, job_id)

    runs = [read_run(path) for path in offline_runs(wandb_dir, job_id)]
    assert len(runs) == 2 and all(r["run"].run_id == job_id for r in runs)  # one W&B run, opened twice
    assert [r["exit_code"] for r in runs] == [0, 0]
    assert sorted(set(runs[0]["history"]) | set(runs[1]["history"])) == steps
    assert max(runs[0]["history"]) < min(runs[1]["history"])  # the resumed claim goes on where the pause stopped


def test_reencrypt_seals_the_key_under_the_newest_key(settings, project):
    from cryptography.fernet import Fernet

    from app.core.crypto import SecretBox
    from app.secrets_at_rest import reencrypt

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    engine = make_engine(settings.resolved_database_url)
    try:
        factory = make_session_factory(engine)
        with factory.begin() as session:
            set_integration_key(session=session, project_name=project["name"], integration="wandb", key=WANDB_KEY,
                                box=SecretBox((old,)))
        assert reencrypt(factory, SecretBox((new, old))).integration_keys == 1
        assert reencrypt(factory, SecretBox((new, old))).integration_keys == 0
        with factory.begin() as session:
            from app.auth.models import IntegrationSecret

            stored = session.get(IntegrationSecret, (project["project_id"], "wandb")).sealed
        assert SecretBox((new,)).open(stored) == WANDB_KEY
    finally:
        engine.dispose()


def test_an_unreachable_wandb_warns_once_and_the_job_succeeds(training_settings, project, tmp_path):
    set_key(training_settings, project["name"])
    env = {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:1", "WANDB_INIT_TIMEOUT": "3",
           "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base, extra_env=env) as (_, log):
        job_id = create_job(sdk, tool_url, integrations=[wandb()])
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed", "cancelled"), timeout=240, interval=0.5)
        assert status_of(sdk, job_id) == "succeeded", log.read_text()[-3000:]
        events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
        worker_log = log.read_text()
    warnings = [e for e in events if "Weights & Biases" in e.message]
    assert len(warnings) == 1 and warnings[0].level == "warn" and "training goes on" in warnings[0].message
    assert all(WANDB_KEY not in e.model_dump_json() for e in events) and WANDB_KEY not in worker_log
