"""A LoRA job trained end to end with its rollouts sampled by a real vLLM server, then served there: the openai SDK
creates it, a real Celery worker trains SmolLM2-135M-Instruct and, after every step, loads the new
adapter on the server; and a job whose vLLM does not answer fails with a clear error."""

from __future__ import annotations

import io
import json
import os
import signal

import httpx
import jsonschema
import openai
import pytest

from app.core.config import Settings
from tests.conftest import (
    VLLM_MODEL, agent_rft_inference, forwarder, free_port, job_body, jsonl, live_server, make_project, question_rows,
    wait_for,
)
from tests.rl.tool_server import tool_server
from tests.test_training_e2e import celery_worker, rows, training_settings  # noqa: F401 - the fixture


# A JSON answer short enough for the job's 16 tokens a turn (a constrained value is valid once complete).
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}}, "required": ["answer"],
                 "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}
# At least 0.5 when the grader was handed the answer as `output_json`, an object (what a structured job's
# graders read), else 0; spread by the answer's length, so that the steps have advantages to train on.
SEES_JSON = {"type": "python", "name": "sees_json", "source": (
    "def grade(sample, item):\n"
    "    if not isinstance(sample.get('output_json'), dict):\n"
    "        return 0.0\n"
    "    return 0.5 + sum(map(ord, sample['output_text'])) % 10 / 20\n")}


def create_job(sdk: openai.OpenAI, tool_url: str, model: str, *, n_rows: int = 4,  # noqa: ANN003
               response_format: dict | None = None, **options) -> str:
    """A LoRA job on `model`; with `response_format`, asked without tools (offered a tool, the base model
    opens a call at once and never answers; the answers are what the format constrains)."""
    train = rows(n_rows)
    if response_format:
        train = [{key: value for key, value in row.items() if key != "tools"} for row in train]
    uploaded = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(train))), purpose="fine-tune")
    grader = SEES_JSON if response_format else {
        "type": "text_similarity", "name": "similar", "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}", "evaluation_metric": "fuzzy_match"}
    return sdk.fine_tuning.jobs.create(model=model, training_file=uploaded.id, seed=7, method={
        "type": "reinforcement", "reinforcement": {
            "grader": grader, **({"response_format": response_format} if response_format else {}),
            "tools": [] if response_format else [{"name": "search", "server_url": tool_url}],
            "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 1, "eval_interval": 2,
                                "eval_samples": 2},
            "max_episode_steps": 1,
            "x_open_model": {"lora_rank": 4, "max_tokens_per_turn": 16, "max_tokens_per_rollout": 24,
                             "temperature": 0.7, **options},
        }}).id


def served(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def test_a_lora_job_is_trained_on_vllm_and_served_there(training_settings: Settings, project, vllm_server):  # noqa: ANN001, F811
    """Rollouts sampled on vLLM, a new adapter loaded after each step, every answer constrained to the
    job's strict json_schema (vLLM's structured outputs); then the job's model and a checkpoint
    answered through the API by an inference server on the vLLM backend, to this project only."""
    training_settings.vllm_urls = [vllm_server]
    serving = training_settings.model_copy(update={"inference_backend": "vllm", "inference_models": [VLLM_MODEL]})
    with agent_rft_inference(serving, token=training_settings.worker_token.get_secret_value()) as (inference, _, _):
        training_settings.inference_url = inference
        with live_server(training_settings) as base, tool_server() as (tool_url, _), \
                openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
                celery_worker(training_settings, base) as (_, log):
            # sampler "auto": the worker has a vLLM server
            # (sampled at temperature 1: short JSON answers at 0.7 often tie within a group, leaving no advantage)
            job_id = create_job(sdk, tool_url, VLLM_MODEL, response_format=ANSWER_FORMAT, temperature=1.0)
            wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status in ("succeeded", "failed"), timeout=600,
                     interval=1.0)
            job = sdk.fine_tuning.jobs.retrieve(job_id)
            assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
            events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
            rollouts = sdk.get(f"/fine_tuning/jobs/{job_id}/rollouts", cast_to=object, options={"params": {"limit": 100}})
            trained_on = served(vllm_server)
            final, streamed = serve_on_vllm(sdk, base, job, training_settings)
            adapters = httpx.get(f"{inference}/healthz", timeout=10).json()["adapters"]
    assert any(e.message.startswith(f"Rollouts are sampled on vLLM: {vllm_server}") for e in events)
    answered = [r for r in rollouts["data"] if r["finish_reason"] == "answered"]
    assert answered, [(r["finish_reason"], r["data"]["final_answer"]) for r in rollouts["data"]]
    for rollout in answered:  # every answer fits, and the grader got it as output_json
        assert jsonschema.validate(json.loads(rollout["data"]["final_answer"]), ANSWER_SCHEMA) is None
        assert rollout["reward"] >= 0.5 and rollout["data"]["output_json"] == json.loads(rollout["data"]["final_answer"])
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    assert [m["train"]["policy_version"] for m in metrics] == [0, 1]  # step 1 on the base, step 2 on v1
    # The trainer scores each answer under the masks vLLM sampled it with: the log-probs agree.
    mismatches = [m["train"]["logprob_mismatch"] for m in metrics]  # None: a step whose groups all tied
    assert any(x is not None for x in mismatches) and all(x is None or x < 0.1 for x in mismatches), mismatches
    assert not {name for name in trained_on if name.startswith(job_id)}  # unloaded when the job ended
    policy_dirs = list((training_settings.checkpoint_dir / job_id / "policy").iterdir())
    assert [p.name for p in policy_dirs] == ["v2"]
    assert final == streamed
    assert adapters and set(adapters) <= served(vllm_server)  # the checkpoint's adapter, loaded on demand


def serve_on_vllm(sdk: openai.OpenAI, base: str, job, settings: Settings) -> tuple[str, str]:  # noqa: ANN001
    """The job's model (greedy, and streamed) and its first checkpoint through the API; another
    project cannot see them."""
    checkpoints = sorted(sdk.fine_tuning.jobs.checkpoints.list(job.id), key=lambda c: c.step_number)
    question = dict(messages=[{"role": "user", "content": "Name three colours of the rainbow."}], max_tokens=16,
                    temperature=0)
    final = sdk.chat.completions.create(model=job.fine_tuned_model, **question)
    first = sdk.chat.completions.create(model=checkpoints[0].fine_tuned_model_checkpoint, **question)
    chunks = sdk.chat.completions.create(model=job.fine_tuned_model, stream=True, **question)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert final.usage.completion_tokens == 16 and final.model == job.fine_tuned_model
    assert first.model == checkpoints[0].fine_tuned_model_checkpoint and first.choices[0].message.content
    other = make_project(settings)
    with openai.OpenAI(base_url=f"{base}/v1", api_key=other["key"], max_retries=0) as outsider, \
            pytest.raises(openai.NotFoundError):
        outsider.chat.completions.create(model=job.fine_tuned_model, **question)
    return final.choices[0].message.content, streamed


@pytest.mark.parametrize("servers", ["dead", "none"])
def test_a_job_whose_vllm_does_not_answer_fails_with_a_clear_error(training_settings: Settings, project,  # noqa: ANN001, F811
                                                                  servers):
    """Asked for vLLM, a job fails with sampler_unavailable where its server is down or the worker
    has none configured."""
    dead = f"http://127.0.0.1:{free_port()}"
    training_settings.vllm_urls = [dead] if servers == "dead" else []
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        job_id = create_job(sdk, tool_url, "tiny-smollm2", sampler="vllm")
        wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status in ("succeeded", "failed"), timeout=180,
                 interval=0.5)
        job = sdk.fine_tuning.jobs.retrieve(job_id)
    assert job.status == "failed", log.read_text()[-3000:]
    expected = dead if servers == "dead" else "has no vLLM servers (AGENT_RFT_VLLM_URLS)"
    assert job.error.code == "sampler_unavailable" and expected in job.error.message
    assert job.error.param == "method.reinforcement.x_open_model.sampler"


def test_vllm_sampling_of_a_full_fine_tune_is_refused_at_creation(api):  # noqa: ANN001
    """The choice made for full fine-tuning on this backend: a clear 400 at creation, not a job that
    fails later (reloading all weights on every server each step is not supported)."""
    file_id = api.upload_ok(question_rows(3))
    body = job_body(file_id, reinforcement={"x_open_model": {"training_mode": "full", "sampler": "vllm"}})
    response = api.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "LoRA policies only" in error["message"] and "x_open_model" in (error["param"] or "")
    body = job_body(file_id, reinforcement={"x_open_model": {"training_mode": "full", "sampler": "engine"}})
    assert api.post("/v1/fine_tuning/jobs", json=body).status_code == 200


def test_a_vllm_server_killed_mid_job_is_failed_over(training_settings: Settings, project, vllm_server):  # noqa: ANN001, F811
    """Two servers; the second is killed after step 1: step 2's requests go to the first, an event
    says which server failed, and the job succeeds. The second server is a second address of the
    real one (a forwarding process, killed like a crashed server), which spares starting another."""
    with forwarder(vllm_server) as (second, process):
        training_settings.vllm_urls = [vllm_server, second]
        with live_server(training_settings) as base, tool_server() as (tool_url, _), \
                openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
                celery_worker(training_settings, base) as (_, log):
            job_id = create_job(sdk, tool_url, VLLM_MODEL)
            wait_for(lambda: any(e.type == "metrics" for e in sdk.fine_tuning.jobs.list_events(job_id)),
                     timeout=600, interval=0.5)
            os.killpg(process.pid, signal.SIGKILL)
            wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job_id).status in ("succeeded", "failed"), timeout=600,
                     interval=1.0)
            job = sdk.fine_tuning.jobs.retrieve(job_id)
            assert job.status == "succeeded", (job.error, log.read_text()[-3000:])
            events = list(sdk.fine_tuning.jobs.list_events(job_id, limit=100))
    assert any(e.message.startswith(f"Rollouts are sampled on vLLM: {vllm_server}, {second}") for e in events)
    failed = [e for e in events if e.level == "warn" and f"sampling server {second} failed" in e.message]
    assert failed, [e.message for e in events]
    assert sorted(e.data["step"] for e in events if e.type == "metrics") == [1, 2]
