"""`agent-rft files|jobs|eval` as a user runs them: the installed executable against a real
server (files, jobs) or a real tool server (eval)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from app.core.db import make_engine, make_session_factory
from app.jobs.models import Job
from app.jobs.state import JobStatus, add_event, transition
from tests.conftest import jsonl, live_server, question_rows, wait_for
from tests.rl.tool_server import tool_server

AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
          "reference": "{{item.reference_answer}}", "operation": "eq"}
JOB_YAML = """\
model: SmolLM2-135M-Instruct
training_file: train.jsonl
seed: 7
suffix: cli
metadata: {{team: cli-test}}
method:
  type: reinforcement
  reinforcement:
    grader: {grader}
    tools:
      - name: search
        server_url: http://127.0.0.1:8765/tools
    hyperparameters: {{batch_size: {batch_size}}}
"""


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "AGENT_RFT_API_KEY")}
    return {**env, "AGENT_RFT_DATA_DIR": str(tmp_path / "data"), "AGENT_RFT_OUTBOUND_ALLOWLIST": "127.0.0.1", **extra}


def agent_rft(*args: str, env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([AGENT_RFT, *args], check=False, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def server(settings, project, tmp_path):
    """(env for the CLI, an SDK client) against a live server."""
    with live_server(settings) as base_url:
        env = cli_env(tmp_path, AGENT_RFT_BASE_URL=f"{base_url}/v1", AGENT_RFT_API_KEY=project["key"])
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key=project["key"], max_retries=0) as sdk:
            yield env, sdk


def write_job_yaml(tmp_path: Path, name: str, *, batch_size: int) -> Path:
    (tmp_path / "train.jsonl").write_bytes(jsonl(question_rows(4)))
    path = tmp_path / name
    path.write_text(JOB_YAML.format(grader=json.dumps(GRADER), batch_size=batch_size))
    return path


def test_upload_create_list_and_events(server, tmp_path):
    env, sdk = server
    data = tmp_path / "rows.jsonl"
    data.write_bytes(jsonl(question_rows(2)))
    uploaded = agent_rft("files", "upload", str(data), env=env)
    assert uploaded.returncode == 0, uploaded.stderr
    file_id = uploaded.stdout.split()[0]
    assert file_id.startswith("file-") and f"{data.stat().st_size} bytes" in uploaded.stdout
    assert file_id in [f.id for f in sdk.files.list()]

    wrong_purpose = agent_rft("files", "upload", str(data), "--purpose", "assistants", env=env)
    assert wrong_purpose.returncode == 1 and "(param: purpose)" in wrong_purpose.stderr

    created = agent_rft("jobs", "create", "--config", str(write_job_yaml(tmp_path, "job.yaml", batch_size=2)), env=env)
    assert created.returncode == 0, created.stderr
    job_id = created.stdout.split()[-2]
    assert job_id.startswith("ftjob-") and created.stdout.strip().endswith("validating_files")
    job = sdk.fine_tuning.jobs.retrieve(job_id)
    assert job.seed == 7 and job.metadata == {"team": "cli-test"}
    assert sdk.files.retrieve(job.training_file).filename == "train.jsonl"  # the local path was uploaded

    too_big = agent_rft("jobs", "create", "--config", str(write_job_yaml(tmp_path, "bad.yaml", batch_size=100000)),
                        env=env)
    assert too_big.returncode == 1
    assert "invalid_value" in too_big.stderr and "method.reinforcement.hyperparameters.batch_size" in too_big.stderr

    wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status == "queued")
    listed = agent_rft("jobs", "list", "--metadata", "team=cli-test", env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.strip().splitlines()
    assert header.split() == ["ID", "STATUS", "MODEL", "CREATED", "FINE_TUNED_MODEL"]
    assert row.split()[:3] == [job_id, "queued", "SmolLM2-135M-Instruct"]
    assert len(agent_rft("jobs", "list", "--metadata", "team=other", env=env).stdout.strip().splitlines()) == 1

    events = agent_rft("jobs", "events", job_id, env=env)
    assert events.returncode == 0, events.stderr
    lines = events.stdout.strip().splitlines()
    assert lines[0].split()[2:] == ["info", "Created", "fine-tuning", "job:", job_id]  # oldest first
    assert lines[-1].endswith("Job sent to the training queue.")
    assert len(agent_rft("jobs", "events", job_id, "--limit", "1", env=env).stdout.strip().splitlines()) == 1

    missing = agent_rft("jobs", "events", "ftjob-missing", env=env)
    assert missing.returncode == 1 and "fine_tuning_job_not_found" in missing.stderr


def test_missing_key_and_unreachable_server_are_clear_errors(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(jsonl(question_rows(1)))
    no_key = agent_rft("files", "upload", str(data), env=cli_env(tmp_path))
    assert no_key.returncode == 1 and "no API key" in no_key.stderr and "Traceback" not in no_key.stderr
    down = agent_rft("jobs", "list", "--base-url", "http://127.0.0.1:9/v1", "--api-key", "sk-x", env=cli_env(tmp_path))
    assert down.returncode == 1 and "cannot reach the server" in down.stderr


def queued_job(sdk: openai.OpenAI) -> str:
    training = sdk.files.create(file=("t.jsonl", jsonl(question_rows(4, tools=False))), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=training.id,
                                      method={"type": "reinforcement", "reinforcement": {"grader": GRADER}})
    wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status == "queued")
    return job.id


def in_db(settings, job_id: str, change) -> None:
    """What a worker would report, written as the control plane stores it."""
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        change(session, session.query(Job).filter_by(id=job_id).one())
    engine.dispose()


def step_metrics(step: int, reward: float, valid: float | None = None) -> dict:
    scores = {"train_reward_mean": reward, **({"valid_reward_mean": valid} if valid is not None else {})}
    return {"step": step, "total_steps": 4, "scores": scores, "tools": {"tool_calls_per_rollout": 1.5},
            "timing": {"step": {"full_iteration": 3.0}}}


def watch(job_id: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([AGENT_RFT, "jobs", "watch", job_id, "--interval", "0.2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_watch_shows_progress_and_exits_1_when_the_job_is_cancelled(server, settings):
    env, sdk = server
    job_id = queued_job(sdk)
    in_db(settings, job_id, lambda s, job: (
        transition(s, job, JobStatus.RUNNING, message="Training started."),
        add_event(s, job, "Step 2/4", type="metrics", data=step_metrics(2, 0.25, valid=0.5)),
    ))
    watcher = watch(job_id, env)
    try:
        wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status == "running")
        sdk.fine_tuning.jobs.cancel(job_id)
        stdout, stderr = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 1, stderr
    assert "step 2/4, train reward 0.250, valid reward 0.500, tool calls/rollout 1.50, ETA 6 s" in stdout
    assert stdout.strip().splitlines()[-1] == "cancelled"

    events = agent_rft("jobs", "events", job_id, env=env).stdout
    assert "step 2/4, train reward 0.250, valid reward 0.500, tool calls/rollout 1.50" in events


def test_watch_exits_0_with_the_fine_tuned_model_when_the_job_succeeds(server, settings):
    env, sdk = server
    job_id = queued_job(sdk)
    in_db(settings, job_id, lambda s, job: transition(s, job, JobStatus.RUNNING, message="Training started."))
    watcher = watch(job_id, env)
    try:
        def succeed(s, job) -> None:
            add_event(s, job, "Step 4/4", type="metrics", data=step_metrics(4, 0.75))
            job.fine_tuned_model = f"{job_id}:final"
            transition(s, job, JobStatus.SUCCEEDED, message="The job has successfully completed.")

        in_db(settings, job_id, succeed)
        stdout, stderr = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, stderr
    assert "step 4/4, train reward 0.750" in stdout
    assert stdout.strip().splitlines()[-1] == f"succeeded: fine_tuned_model {job_id}:final"


@pytest.fixture
def eval_inputs(tmp_path):
    search = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                               "parameters": {"type": "object",
                                                              "properties": {"query": {"type": "string"}}}}}
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Revenue of ACME in {y}?"}],
                                          "tools": [search], "reference_answer": "1"}) for y in (2021, 2022, 2023)))
    grader = tmp_path / "grader.json"
    grader.write_text(json.dumps(GRADER))
    with tool_server() as (url, _):
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps([{"name": "search", "server_url": url}]))
        yield ["--data", str(data), "--tools", str(tools), "--grader", str(grader), "--limit", "2", "--n", "2",
               "--max-tokens-per-turn", "16", "--max-tokens-per-rollout", "32"]


def test_eval_prints_accuracy_and_tool_use_and_writes_json(eval_inputs, tmp_path):
    out = tmp_path / "eval.json"
    result = agent_rft("eval", "--model", "tiny-smollm2", *eval_inputs, "--json", str(out), env=cli_env(tmp_path),
                       timeout=300)
    assert result.returncode == 0, result.stderr
    for label in ("mean reward", "passed", "tool calls per rollout", "completion tokens per rollout",
                  "wall time per rollout"):
        assert label in result.stdout
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-smollm2" and report["summary"]["rollouts"] == 4
    assert 0.0 <= report["accuracy"]["mean_reward"] <= 1.0 and report["accuracy"]["grader_errors"] == 0
    assert {r["sample_index"] for r in report["rollouts"]} == {0, 1}
    assert all("reward" in r and "passed" in r for r in report["rollouts"])


def test_eval_of_a_lora_checkpoint_directory(eval_inputs, tmp_path):
    from workers.models.loading import load_model
    from workers.models.lora import apply_lora

    checkpoint = tmp_path / "step-3"
    apply_lora(load_model("tiny-smollm2"), rank=4, alpha=8.0).save_pretrained(checkpoint)
    assert (checkpoint / "adapter_config.json").is_file()
    result = agent_rft("eval", "--model", str(checkpoint), *eval_inputs, env=cli_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"model{' ' * 31} {checkpoint}" in result.stdout and "mean reward" in result.stdout


def test_eval_refuses_a_bad_grader(eval_inputs, tmp_path):
    bad = tmp_path / "bad_grader.json"
    bad.write_text(json.dumps({**GRADER, "operation": "nope"}))
    inputs = [bad if part.endswith("grader.json") else part for part in eval_inputs]
    result = agent_rft("eval", "--model", "tiny-smollm2", *map(str, inputs), env=cli_env(tmp_path))
    assert result.returncode == 1 and "invalid grader" in result.stderr and "operation" in result.stderr


def test_eval_reports_each_sub_grader_of_a_multi_grader(eval_inputs, tmp_path):
    multi = {"type": "multi", "name": "both", "calculate_output": "0.25 * always + 0.75 * never", "graders": {
        "always": {"type": "string_check", "name": "always", "input": "{{item.reference_answer}}", "reference": "1",
                   "operation": "eq"},
        "never": {"type": "string_check", "name": "never", "input": "{{item.reference_answer}}", "reference": "2",
                  "operation": "eq"}}}
    grader = tmp_path / "multi.json"
    grader.write_text(json.dumps(multi))
    inputs = [str(grader) if part.endswith("grader.json") else part for part in eval_inputs]
    out = tmp_path / "eval.json"
    result = agent_rft("eval", "--model", "tiny-smollm2", *inputs, "--json", str(out), env=cli_env(tmp_path),
                       timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["accuracy"]["sub_rewards"] == {"always": 1.0, "never": 0.0}
    assert report["accuracy"]["mean_reward"] == 0.25
    assert all(r["sub_rewards"] == {"always": 1.0, "never": 0.0} for r in report["rollouts"])
    assert "mean always" in result.stdout and "mean never" in result.stdout
