"""Supervised fine-tuning jobs (`method.type = "supervised"`), the control plane's side: creation
as OpenAI's SDK drives it (the method block, its defaults, a missing method, the deprecated
top-level hyperparameters), the rows' checks with line numbers, the stored form the worker
claims, the resolved hyperparameters, and the lifecycle actions."""

from __future__ import annotations

import io
import json
from typing import Any

import openai
import pytest
from openai.types.fine_tuning import FineTuningJob

from app.core.db import make_engine, make_session_factory
from app.jobs.models import Job
from app.jobs.worker_schemas import ClaimedMethod
from tests.conftest import job_body, jsonl, live_server, question_rows, wait_for
from tests.test_internal import Worker
from tests.test_openai_sdk import strict

JOBS = "/v1/fine_tuning/jobs"
MODEL = "SmolLM2-135M-Instruct"
DEFAULT_OPTIONS = {"training_mode": "lora", "lora_rank": 16, "lora_alpha": 32, "learning_rate": None,
                   "dtype": "auto", "training_processes": None, "max_seq_tokens": 4096, "eval_interval": None}
AUTO = {"batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": "auto"}


def chat_rows(n: int = 3) -> list[dict[str, Any]]:
    """Rows in OpenAI's supervised chat format."""
    return [{"messages": [{"role": "system", "content": "Answer with a number."},
                          {"role": "user", "content": f"What was revenue in year {2000 + i}?"},
                          {"role": "assistant", "content": str(100 + i)}]} for i in range(n)]


def stored_method(settings, job_id: str) -> dict[str, Any]:  # noqa: ANN001
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine)() as session:
            return session.query(Job).filter_by(id=job_id).one().method
    finally:
        engine.dispose()


def settled(api, job_id: str) -> dict[str, Any]:  # noqa: ANN001
    """The job once its files are validated (queued or failed)."""
    return wait_for(lambda: (j := api.get(f"{JOBS}/{job_id}").json())["status"] != "validating_files" and j)


@pytest.fixture
def sdk(settings, project):  # noqa: ANN001, ANN201
    with live_server(settings) as base_url:
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key=project["key"], max_retries=0) as client:
            yield client


def upload(sdk: openai.OpenAI, rows: list[dict[str, Any]]) -> str:
    return sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(rows))), purpose="fine-tune").id


# --- creation through the SDK -----------------------------------------------------------------

def test_sdk_creates_a_supervised_job_with_every_default_stored(sdk, settings):
    job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=upload(sdk, chat_rows()),
                                      method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}})
    strict(FineTuningJob, job)
    assert job.method.type == "supervised" and job.method.supervised.hyperparameters.n_epochs == 2
    shown = job.model_dump(mode="json")
    expected = {"type": "supervised", "supervised": {"hyperparameters": {**AUTO, "n_epochs": 2},
                                                     "x_open_model": DEFAULT_OPTIONS}}
    assert {k: v for k, v in shown["method"].items() if v is not None} == expected
    assert shown["hyperparameters"] == {**AUTO, "n_epochs": 2}
    assert stored_method(settings, job.id) == expected  # the form the worker reads
    queued = wait_for(lambda: (j := sdk.fine_tuning.jobs.retrieve(job.id)).status == "queued" and j)
    strict(FineTuningJob, queued)


def test_without_a_method_the_job_is_supervised_as_on_openai(sdk):
    job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=upload(sdk, chat_rows()))
    assert job.method.type == "supervised"
    assert job.model_dump(mode="json")["method"]["supervised"] == {"hyperparameters": AUTO,
                                                                   "x_open_model": DEFAULT_OPTIONS}
    assert job.hyperparameters.n_epochs == "auto"


def test_deprecated_top_level_hyperparameters_are_a_supervised_jobs(sdk):
    file_id = upload(sdk, chat_rows())
    hp = {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 0.5}
    for method in (None, {"type": "supervised"}, {"type": "supervised", "supervised": {"x_open_model": {"lora_rank": 8}}}):
        extra = {"method": method} if method else {}
        job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=file_id, hyperparameters=hp, **extra)
        assert job.method.supervised.hyperparameters.model_dump() == hp
        assert job.hyperparameters.model_dump(exclude_none=True) == hp
    assert job.model_dump(mode="json")["method"]["supervised"]["x_open_model"]["lora_rank"] == 8


def test_sdk_lifecycle_of_a_supervised_job(sdk):
    job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=upload(sdk, chat_rows()), metadata={"kind": "sft"},
                                      method={"type": "supervised"})
    wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status == "queued")
    assert [j.id for j in sdk.fine_tuning.jobs.list(metadata={"kind": "sft"})] == [job.id]
    assert sdk.fine_tuning.jobs.retrieve(job.id).method.type == "supervised"
    assert sdk.fine_tuning.jobs.pause(job.id).status == "paused"
    resumed = sdk.fine_tuning.jobs.resume(job.id)
    assert resumed.status == "queued" and resumed.method.type == "supervised"
    cancelled = strict(FineTuningJob, sdk.fine_tuning.jobs.cancel(job.id))
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    messages = [e.message for e in sdk.fine_tuning.jobs.list_events(job.id, limit=50)]
    assert {"Job paused by user.", "Job resumed by user.", "Job cancelled by user."} <= set(messages)


# --- what is refused --------------------------------------------------------------------------

def test_sdk_sees_the_refusals(sdk):
    file_id = upload(sdk, chat_rows())
    with pytest.raises(openai.BadRequestError) as both:
        sdk.fine_tuning.jobs.create(model=MODEL, training_file=file_id, hyperparameters={"n_epochs": 2},
                                    method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}})
    assert both.value.code == "invalid_value" and both.value.param == "hyperparameters"
    with pytest.raises(openai.BadRequestError) as other:
        sdk.fine_tuning.jobs.create(model=MODEL, training_file=file_id, method={"type": "ppo"})
    assert other.value.param == "method.type"
    assert list(sdk.fine_tuning.jobs.list()) == []


BAD_BODIES = [
    # (extra fields of the body, expected param)
    ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"batch_size": 257}}, "hyperparameters.batch_size"),
    ({"hyperparameters": {"learning_rate_multiplier": 0}}, "hyperparameters.learning_rate_multiplier"),
    ({"hyperparameters": {"compute_multiplier": 2}}, "hyperparameters.compute_multiplier"),  # reinforcement's only
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 51}}}},
     "method.supervised.hyperparameters.n_epochs"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"eval_interval": 3}}}},
     "method.supervised.hyperparameters.eval_interval"),
    ({"method": {"type": "supervised", "supervised": {"x_open_model": {"max_seq_tokens": 15}}}},
     "method.supervised.x_open_model.max_seq_tokens"),
    ({"method": {"type": "supervised", "supervised": {"x_open_model": {"max_seq_tokens": 262145}}}},
     "method.supervised.x_open_model.max_seq_tokens"),
    ({"method": {"type": "supervised", "supervised": {"x_open_model": {"eval_interval": 0}}}},
     "method.supervised.x_open_model.eval_interval"),
    ({"method": {"type": "supervised", "supervised": {"x_open_model": {"loss": "grpo"}}}},  # reinforcement's only
     "method.supervised.x_open_model.loss"),
    ({"method": {"type": "supervised", "supervised": {"x_open_model": {"dtype": "float16"}}}},
     "method.supervised.x_open_model.dtype"),
    ({"method": {"type": "supervised", "supervised": {"grader": {}}}}, "method.supervised.grader"),
]


@pytest.mark.parametrize("extra,param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_supervised_requests_get_400_naming_the_field(api, extra, param):
    body = {"model": MODEL, "training_file": api.upload_ok(chat_rows()), **extra}
    response = api.post(JOBS, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error
    assert api.get(JOBS).json()["data"] == []


def test_top_level_hyperparameters_stay_refused_for_reinforcement(api):
    body = {**job_body(api.upload_ok(question_rows())), "hyperparameters": {"n_epochs": 2}}
    error = api.post(JOBS, json=body).json()["error"]
    assert error["param"] == "hyperparameters" and "method.reinforcement.hyperparameters" in error["message"]


def test_a_diagnostic_needs_a_reinforcement_method(api):
    file_id = api.upload_ok(chat_rows())
    for method in ({"type": "supervised"}, {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}}):
        response = api.post("/v1/fine_tuning/alpha/diagnostics", json={"model": MODEL, "training_file": file_id,
                                                                       "method": method})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "method.type" and error["code"] == "unsupported_method"
        assert "'reinforcement'" in error["message"] and "'supervised'" in error["message"]


# --- the rows ---------------------------------------------------------------------------------

def sft_job(api, rows: list[Any], **body: Any) -> dict[str, Any]:  # noqa: ANN001
    content = b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in rows)
    response = api.post(JOBS, json={"model": MODEL, "training_file": api.upload_ok(content),
                                    "method": {"type": "supervised"}, **body})
    assert response.status_code == 200, response.text
    return settled(api, response.json()["id"])


def turn(role: str, content: str | None = "x", **fields: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **fields}


CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{\"query\": \"q\"}"}}
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}

BAD_ROWS = [
    # (row, error code, how the line's message starts)
    ({"messages": [turn("user"), turn("robot"), turn("assistant")]}, "invalid_role", "messages[1].role"),
    ({"messages": [turn("system"), turn("user")]}, "missing_assistant_message", "the row has no assistant message"),
    ({"messages": [turn("user"), turn("assistant", weight=True)]}, "invalid_weight", "messages[1].weight must be 0 or 1; got True"),
    ({"messages": [turn("user"), turn("assistant", weight=0.5)]}, "invalid_weight", "messages[1].weight must be 0 or 1; got 0.5"),
    ({"messages": [turn("user"), turn("assistant", weight=1.0)]}, "invalid_weight", "messages[1].weight must be 0 or 1; got 1.0"),
    ({"messages": [turn("user", weight=1), turn("assistant")]}, "invalid_weight", "messages[0].weight is allowed on assistant"),
    ({"messages": [turn("user"), turn("assistant", weight=0), turn("user"), turn("assistant", weight=0)]},
     "no_trained_message", "every assistant message has weight 0"),
    ({"messages": [turn("user"), turn("assistant", None, tool_calls=[CALL]), turn("tool"), turn("assistant")]},
     "invalid_message", "messages[2] has role 'tool' but no tool_call_id"),
    ({"messages": [turn("user"), turn("assistant", None, tool_calls=[{"id": "c"}])]}, "invalid_message",
     "messages[1].tool_calls[0]"),
    ({"messages": [turn("user"), turn("assistant")], "tools": [{"type": "function"}]}, "invalid_tools", "tools[0]"),
    ({"messages": [turn("user"), turn("assistant")], "parallel_tool_calls": "yes"}, "invalid_row",
     "'parallel_tool_calls' must be true or false"),
    ({"messages": []}, "missing_messages", "'messages' must be a non-empty list"),
    ({"prompt": "p", "completion": "c"}, "missing_messages", "the row has no 'messages'"),
    ("{not json", "invalid_json", "not valid JSON"),
]


@pytest.mark.parametrize("row,code,fragment", BAD_ROWS, ids=[c for _, c, _ in BAD_ROWS])
def test_each_bad_row_fails_the_job_with_its_line_number(api, row, code, fragment):
    job = sft_job(api, [chat_rows(1)[0], row])
    assert job["status"] == "failed", job
    error = job["error"]
    assert error["code"] == code and error["param"] == "training_file", error
    assert f"line 2: {fragment}" in error["message"] and "1 invalid line" in error["message"], error["message"]


def test_rows_with_tools_weights_and_every_role_are_valid(api):
    row = {"messages": [turn("developer"), turn("user"), turn("assistant", "draft", weight=0),
                        turn("user", "again"), turn("assistant", None, tool_calls=[CALL]),
                        turn("tool", "42", tool_call_id="call_1"), turn("assistant", "42", weight=1)],
           "tools": [TOOL], "parallel_tool_calls": False}
    job = sft_job(api, [row, *chat_rows(2)])
    assert job["status"] == "queued", job["error"]
    events = [e["message"] for e in api.get(f"{JOBS}/{job['id']}/events").json()["data"]]
    assert any("3 rows" in m for m in events)


def test_a_reinforcement_prompt_is_not_a_supervised_row_nor_the_reverse(api):
    assert sft_job(api, question_rows(1))["error"]["code"] == "missing_assistant_message"
    rl_file = api.upload_ok(chat_rows(1))
    job = settled(api, api.post(JOBS, json=job_body(rl_file)).json()["id"])
    assert job["error"]["code"] == "last_message_not_user"


def test_the_validation_file_is_checked_as_supervised_rows(api):
    bad = api.upload_ok(jsonl([chat_rows(1)[0], {"messages": [turn("user"), turn("assistant", weight=2)]}]))
    job = sft_job(api, chat_rows(2), validation_file=bad)
    assert job["status"] == "failed" and job["error"]["param"] == "validation_file"
    assert "line 2: messages[1].weight must be 0 or 1" in job["error"]["message"]


# --- the worker's view ------------------------------------------------------------------------

def test_the_claim_carries_the_stored_supervised_block(api, client, settings):
    job = sft_job(api, chat_rows(), method={"type": "supervised", "supervised": {
        "hyperparameters": {"batch_size": 2}, "x_open_model": {"training_mode": "full", "max_seq_tokens": 512}}})
    claim = Worker(client, settings.worker_token.get_secret_value()).claim(job["id"])
    assert claim.status_code == 200, claim.text
    method = claim.json()["job"]["method"]
    assert method["type"] == "supervised" and method["reinforcement"] is None
    assert method["supervised"] == stored_method(settings, job["id"])["supervised"] == {
        "hyperparameters": {**AUTO, "batch_size": 2},
        "x_open_model": {**DEFAULT_OPTIONS, "training_mode": "full", "max_seq_tokens": 512}}


def test_a_claimed_method_has_the_block_its_type_names():
    with pytest.raises(ValueError, match="'supervised' block"):
        ClaimedMethod.model_validate({"type": "supervised"})
    with pytest.raises(ValueError, match="'dpo' block"):
        ClaimedMethod.model_validate({"type": "dpo"})


def test_resolved_hyperparameters_replace_auto_on_a_supervised_job(api, settings):
    job = sft_job(api, chat_rows(), method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}})
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        session.query(Job).filter_by(id=job["id"]).one().resolved_hyperparameters = {"batch_size": 8, "learning_rate_multiplier": 1.5,
                                                                "n_epochs": 2, "warmup_steps": 3}
    engine.dispose()
    shown = api.get(f"{JOBS}/{job['id']}").json()
    resolved = {"batch_size": 8, "learning_rate_multiplier": 1.5, "n_epochs": 2}
    assert shown["hyperparameters"] == resolved
    assert shown["method"]["supervised"]["hyperparameters"] == resolved  # only the keys the method has
    assert stored_method(settings, job["id"])["supervised"]["hyperparameters"] == {**AUTO, "n_epochs": 2}
