"""The variance diagnostic end to end: the API, a real Celery worker running the tiny model with
the training engine against real tool and grader servers, the CLI, a job that runs its
diagnostic first, cancel, and TAT-QA data when it is present."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import openai
import pytest
import yaml

from app import cli_client
from app.core.config import Settings
from tests.conftest import jsonl, live_server, wait_for
from tests.diagnostics.scripted_grader import scripted_grader, scripted_rows
from tests.rl.tool_server import tool_server
from tests.test_training_e2e import AGENT_RFT, celery_worker, training_settings  # noqa: F401 - a fixture

KINDS = ["always0", "always1", "mixed"] * 2
EXPECTED = {"always0": "always_0", "always1": "always_1", "mixed": "mixed"}
TATQA_DEV = Path(__file__).resolve().parents[2].parent / "shared/data/tatqa/tatqa_dataset_dev.json"
TINY = {"lora_rank": 4, "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24}


def method(grader_url: str, tool_url: str, **x_open_model) -> dict:  # noqa: ANN003
    return {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "endpoint", "name": "scripted", "url": grader_url},
        "tools": [{"name": "search", "server_url": tool_url}],
        "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 1, "eval_interval": 1,
                            "eval_samples": 2},
        "max_episode_steps": 2,
        "x_open_model": {**TINY, **x_open_model},
    }}


def sdk_for(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_cli_diagnose_reports_each_kind_of_sample_exactly(training_settings: Settings, project, tmp_path):  # noqa: F811
    (tmp_path / "train.jsonl").write_bytes(jsonl(scripted_rows(KINDS)))
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            scripted_grader() as (grader_url, script), sdk_for(base, project["key"]) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        config = {"model": "tiny-smollm2", "training_file": "train.jsonl", "seed": 3,
                  "method": method(grader_url, tool_url)}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, "AGENT_RFT_BASE_URL": f"{base}/v1", "AGENT_RFT_API_KEY": project["key"]}
        run = subprocess.run([AGENT_RFT, "diagnose", "--config", str(tmp_path / "job.yaml"), "--runs", "3",
                              "--interval", "0.3"], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.stdout, run.stderr, log.read_text()[-3000:])
        out = run.stdout
        assert "uploaded" in out and "6/6 samples, 18 rollouts" in out
        assert "mixed scores (signal)            33% (2)" in out
        assert "always 0                         33% (2)" in out and "always 1                         33% (2)" in out
        assert "verdict (ok): 33% of samples have signal (2 of 6 got different scores over 3 runs)" in out
        assert "tool calls per rollout" in out and "grader errors                    0% of rollouts" in out
        assert "--- trace_" in out  # the example transcripts

        diagnostic_id = next(word for word in out.split() if word.startswith("diag-"))
        diagnostic = cli_client.retrieve_diagnostic(sdk, diagnostic_id)
        assert diagnostic["status"] == "succeeded" and diagnostic["runs_per_sample"] == 3
        assert diagnostic["progress"] == {"samples_done": 6, "samples_total": 6, "rollouts_done": 18,
                                          "rollouts_total": 18}
        assert [s["signal"] for s in diagnostic["samples"]] == [EXPECTED[k] for k in KINDS]
        for sample, kind in zip(diagnostic["samples"], KINDS):
            assert len(sample["scores"]) == 3 and len(sample["rollout_ids"]) == 3
            assert len(sample["finish_reasons"]) == len(sample["latency_s"]) == len(sample["tokens"]) == 3
            if kind == "mixed":
                assert sorted(sample["scores"]) == [0.0, 1.0, 1.0] and sample["std"] > 0
        summary = diagnostic["summary"]
        assert summary["share_always_0"] == summary["share_always_1"] == summary["share_mixed"] == pytest.approx(1 / 3)
        assert summary["mean_reward"] == pytest.approx((0 + 3 + 2) * 2 / 18)
        assert summary["grader_error_rate"] == 0 and summary["rollouts"] == 18
        load = {p["compute_multiplier"]: (p["batch_size"], p["group_size"], p["configured"])
                for p in summary["load_projection"]}
        assert load == {0.5: (2, 2, True), 1.0: (2, 4, False), 2.0: (2, 8, False), 4.0: (2, 16, False),
                        10.0: (2, 40, False)}
        assert sum(script.calls.values()) == 18

        # Browsable like a job's rollouts: every run of every sample, with its transcript.
        rollouts = cli_client.diagnostic_rollouts(sdk, diagnostic_id)
        assert sorted((r["sample_index"], r["run_index"]) for r in rollouts) == [(s, k) for s in range(6)
                                                                                for k in range(3)]
        assert all(r["data"]["messages"][0]["content"].startswith("Question") for r in rollouts)
        assert {r["id"] for r in rollouts} == {i for s in diagnostic["samples"] for i in s["rollout_ids"]}


def test_cancel_stops_the_worker_mid_run(training_settings: Settings, project):  # noqa: F811
    rows = scripted_rows(["mixed"] * 48)
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            scripted_grader(hold_from=16) as (grader_url, script), sdk_for(base, project["key"]) as sdk, \
            celery_worker(training_settings, base) as (worker, log):
        training = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(rows))), purpose="fine-tune")
        created = cli_client.create_diagnostic(sdk, {"model": "tiny-smollm2", "training_file": training.id,
                                                     "method": method(grader_url, tool_url), "runs_per_sample": 2})
        diagnostic_id = created["id"]
        # The first 16 samples (one chunk of 32 rollouts) are graded; the next chunk's gradings wait.
        wait_for(script.held.is_set, timeout=180, interval=0.2)
        assert cli_client.retrieve_diagnostic(sdk, diagnostic_id)["progress"]["samples_done"] == 16
        cancelled = cli_client.cancel_diagnostic(sdk, diagnostic_id)
        assert cancelled["status"] == "cancelled"
        script.release.set()
        # The worker finishes the chunk in flight, sees the cancel at the chunk boundary and stops.
        wait_for(lambda: "diagnostic_id" in log.read_text() and "'status': 'cancelled'" in log.read_text(),
                 timeout=120, interval=0.3)
        final = cli_client.retrieve_diagnostic(sdk, diagnostic_id)
        assert final["status"] == "cancelled" and final["finished_at"]
        assert final["progress"]["samples_done"] == 32 and final["progress"]["samples_total"] == 48
        assert final["summary"]["samples"] == 32 and len(final["samples"]) == 32
        assert max(script.calls) < 32  # nothing of the third chunk was run
        assert worker.poll() is None


def test_a_job_runs_its_diagnostic_first_and_drops_zero_signal_samples(training_settings: Settings,  # noqa: F811
                                                                       project):
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            scripted_grader() as (grader_url, script), sdk_for(base, project["key"]) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        training = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(scripted_rows(KINDS)))),
                                    purpose="fine-tune")
        job = sdk.fine_tuning.jobs.create(model="tiny-smollm2", training_file=training.id, seed=5, method=method(
            grader_url, tool_url, diagnostic={"runs_per_sample": 2, "drop_zero_signal": True}))
        wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed", "cancelled"),
                 timeout=300, interval=0.5)
        done = sdk.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "succeeded", (done.error, log.read_text()[-3000:])
        diagnostic_id = done.diagnostic_id
        assert diagnostic_id and diagnostic_id.startswith("diag-")
        diagnostic = cli_client.retrieve_diagnostic(sdk, diagnostic_id)
        assert diagnostic["status"] == "succeeded" and diagnostic["fine_tuning_job_id"] == job.id
        assert [s["signal"] for s in diagnostic["samples"]] == [EXPECTED[k] for k in KINDS]
        messages = [e.message for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100)]
        assert any(m.startswith(f"Variance diagnostic {diagnostic_id}: 33% of samples have signal") for m in messages)
        dropped = [e for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100) if e.message.startswith("Dropped")]
        assert dropped[0].message == (f"Dropped 4 zero-signal samples of 6 (diagnostic {diagnostic_id}); "
                                      "training on 2 rows.")
        assert dropped[0].data == {"diagnostic_id": diagnostic_id, "dropped": 4, "kept": 2, "rows": 6}
        # Zero-signal items were graded only by the diagnostic (2 runs); mixed ones by training too.
        for row_id, kind in enumerate(KINDS):
            assert (script.calls[row_id] == 2) == (kind != "mixed"), (row_id, kind, script.calls)


def test_a_diagnostic_on_tatqa(training_settings: Settings, project, tmp_path):  # noqa: F811
    if not TATQA_DEV.is_file():
        pytest.skip(f"TAT-QA dev split not found at {TATQA_DEV}; see examples/financial_reports/README.md")
    from examples.financial_reports.corpus import write_corpus
    from examples.financial_reports.server import TOOL_SCHEMAS, create_app
    from examples.financial_reports.tatqa import load_tatqa
    from tests.conftest import serve_app

    loaded = load_tatqa(TATQA_DEV)
    rows = loaded.rows[:3]
    documents = [d for d in loaded.documents if d.path in {r["document"] for r in rows}]
    root = write_corpus(tmp_path / "tatqa", documents, rows)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOL_SCHEMAS]
    with serve_app(create_app(root, index_cache_dir=tmp_path / "index")) as tool_port, \
            live_server(training_settings) as base, sdk_for(base, project["key"]) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        training = sdk.files.create(file=("tatqa.jsonl", io.BytesIO(jsonl(rows))), purpose="fine-tune")
        reinforcement = {
            "grader": {"type": "numeric_match", "name": "amount", "input": "{{sample.output_text}}",
                       "reference": "{{item.answer}}", "scale": "{{item.scale}}"},
            "tools": [{**t, "server_url": f"http://127.0.0.1:{tool_port}/tools/{t['name']}"} for t in tools],
            "max_episode_steps": 2, "x_open_model": TINY}
        diagnostic = cli_client.run_diagnostic(
            sdk, model="tiny-smollm2", training_file=training.id,
            method={"type": "reinforcement", "reinforcement": reinforcement}, runs_per_sample=2, max_samples=2,
            seed=1, interval=0.3, timeout_s=300)
        assert diagnostic["status"] == "succeeded", (diagnostic.get("error"), log.read_text()[-3000:])
        assert diagnostic["progress"]["samples_done"] == diagnostic["progress"]["samples_total"] == 2
        summary = diagnostic["summary"]
        assert summary["rollouts"] == 4 and summary["grader_error_rate"] == 0
        assert sum(v["count"] for v in summary["signal"].values()) == 2
        assert diagnostic["verdict"]["message"] and diagnostic["verdict"]["level"] in ("ok", "warning", "error")
        questions = {r["messages"][-1]["content"] for r in rows}
        rollouts = cli_client.diagnostic_rollouts(sdk, diagnostic["id"])
        assert {r["data"]["messages"][0]["content"] for r in rollouts} <= questions
