"""DPO jobs (`method.type = "dpo"`), the control plane's side: creation as OpenAI's SDK sends it (the
block, its defaults, `beta`'s limits), the rows' checks with line numbers (OpenAI's field names
and the older ones), the stored form the worker claims, and the resolved hyperparameters."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.core.db import make_engine, make_session_factory
from app.jobs.models import Job
from tests.test_internal import Worker
from tests.test_supervised_api import DEFAULT_OPTIONS, MODEL, chat_rows, sdk, settled, stored_method, turn, upload  # noqa: F401

JOBS = "/v1/fine_tuning/jobs"
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{\"query\": \"q\"}"}}
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


def pair(i: int = 0, **fields: Any) -> dict[str, Any]:
    """A preference row: a question, and an answer preferred over a tool call."""
    return {"input": {"messages": [turn("user", f"What was revenue in {2000 + i}?")], "tools": [TOOL]},
            "preferred_output": [turn("assistant", str(100 + i))],
            "non_preferred_output": [turn("assistant", None, tool_calls=[CALL])], **fields}


def dpo_job(api, rows: list[Any], **body: Any) -> dict[str, Any]:  # noqa: ANN001
    content = b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in rows)
    response = api.post(JOBS, json={"model": MODEL, "training_file": api.upload_ok(content),
                                    "method": {"type": "dpo"}, **body})
    assert response.status_code == 200, response.text
    return settled(api, response.json()["id"])


def test_sdk_creates_a_dpo_job_with_every_default_stored(sdk, settings):  # noqa: F811
    job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=upload(sdk, [pair(i) for i in range(3)]),
                                      method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.2
    assert stored_method(settings, job.id) == {"type": "dpo", "dpo": {
        "hyperparameters": {"batch_size": "auto", "n_epochs": "auto", "learning_rate_multiplier": "auto", "beta": 0.2},
        "x_open_model": DEFAULT_OPTIONS}}


@pytest.mark.parametrize("beta", [0, -1, 2.01, "high"])
def test_beta_outside_openais_limits_is_a_400_naming_it(api, beta):
    body = {"model": MODEL, "training_file": api.upload_ok([pair()]),
            "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": beta}}}}
    response = api.post(JOBS, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "method.dpo.hyperparameters.beta"


def test_beta_of_two_and_the_open_model_options_are_accepted(api):
    job = dpo_job(api, [pair()], method={"type": "dpo", "dpo": {
        "hyperparameters": {"beta": 2, "batch_size": 1},
        "x_open_model": {"training_mode": "full", "max_seq_tokens": 512, "dtype": "bfloat16", "lora_rank": 4}}})
    assert job["status"] == "queued", job["error"]
    assert job["method"]["dpo"]["x_open_model"]["training_mode"] == "full"


BAD_ROWS = [
    # (row, error code, how the line's message starts)
    ({"messages": [turn("user"), turn("assistant")]}, "missing_input", "the row has no 'input'"),
    ({"input": {"messages": []}, "preferred_output": [turn("assistant")], "non_preferred_output": [turn("assistant", "y")]},
     "missing_messages", "'input.messages' must be a non-empty list"),
    (pair(input={"messages": [turn("user"), turn("robot")]}), "invalid_role", "input.messages[1].role"),
    (pair(input={"messages": [turn("user"), turn("assistant")]}), "invalid_input", "input.messages must end"),
    (pair(input={"messages": [turn("user")], "tools": [{"type": "function"}]}), "invalid_tools", "input.tools[0]"),
    ({"input": {"messages": [turn("user")]}, "non_preferred_output": [turn("assistant")]}, "missing_output",
     "the row has no 'preferred_output'"),
    (pair(preferred_output=[turn("assistant"), turn("assistant")]), "invalid_output",
     "'preferred_output' must be a list of exactly one assistant message"),
    (pair(non_preferred_output=[turn("user")]), "invalid_output", "non_preferred_output[0].role must be 'assistant'"),
    (pair(non_preferred_output=[turn("assistant", None, tool_calls=[{"id": "c"}])]), "invalid_message",
     "non_preferred_output[0].tool_calls[0]"),
    (pair(non_preferred_output=[turn("assistant", "100")]), "identical_outputs", "the preferred and non-preferred"),
    ("{not json", "invalid_json", "not valid JSON"),
]


@pytest.mark.parametrize("row,code,fragment", BAD_ROWS, ids=[c for _, c, _ in BAD_ROWS])
def test_each_bad_preference_row_fails_the_job_with_its_line_number(api, row, code, fragment):
    job = dpo_job(api, [pair(), row])
    assert job["status"] == "failed", job
    error = job["error"]
    assert error["code"] == code and error["param"] == "training_file", error
    assert f"line 2: {fragment}" in error["message"], error["message"]


def test_the_older_field_names_and_tool_calls_in_answers_are_valid(api):
    old = {"input": {"messages": [turn("system"), turn("user"), turn("assistant", None, tool_calls=[CALL]),
                                  turn("tool", "42", tool_call_id="call_1")], "tools": [TOOL],
                     "parallel_tool_calls": False},
           "preferred_completion": [turn("assistant", "42")],
           "non_preferred_completion": [turn("assistant", None, tool_calls=[CALL])]}
    assert dpo_job(api, [old, pair()])["status"] == "queued"


def test_a_supervised_row_is_not_a_preference_row_and_the_validation_file_is_checked(api):
    assert dpo_job(api, chat_rows(1))["error"]["code"] == "missing_input"
    bad = api.upload_ok([pair(), pair(preferred_output=[])])
    job = dpo_job(api, [pair()], validation_file=bad)
    assert job["status"] == "failed" and job["error"]["param"] == "validation_file"
    assert "line 2: 'preferred_output' must be a list" in job["error"]["message"]


def test_the_claim_carries_the_dpo_block_and_resolved_values_replace_auto(api, client, settings):
    job = dpo_job(api, [pair(i) for i in range(3)])
    claim = Worker(client, settings.worker_token.get_secret_value()).claim(job["id"])
    assert claim.status_code == 200, claim.text
    method = claim.json()["job"]["method"]
    assert method["type"] == "dpo" and method["dpo"] == stored_method(settings, job["id"])["dpo"]
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        session.query(Job).filter_by(id=job["id"]).one().resolved_hyperparameters = {
            "batch_size": 3, "learning_rate_multiplier": 1.0, "n_epochs": 10, "beta": 0.1}
    engine.dispose()
    shown = api.get(f"{JOBS}/{job['id']}").json()
    assert shown["hyperparameters"] == {"batch_size": 3, "learning_rate_multiplier": 1.0, "n_epochs": 10}
    assert shown["method"]["dpo"]["hyperparameters"] == {"batch_size": 3, "learning_rate_multiplier": 1.0,
                                                         "n_epochs": 10, "beta": 0.1}
