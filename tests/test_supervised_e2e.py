"""A supervised job end to end on the real model: the openai SDK creates it, a real Celery worker
trains SmolLM2-135M-Instruct (LoRA) on chat rows with tool calls, its validation loss falls, its
metrics read as OpenAI's, and the fine-tuned model answers chat completions; then a reinforcement
job starts from that fine-tuned model (its adapter trained on), where the base model would never
call a tool, and a DPO job learns from it to answer once a result holds the figure rather than
search again."""

from __future__ import annotations

import io
import json

import jsonschema
import openai
import pytest

from app.core.config import Settings
from examples.financial_reports.traces import preference_pairs
from tests.conftest import agent_rft_inference, jsonl, live_server, make_project, wait_for
from tests.rl.tool_server import tool_server
from tests.test_evals_e2e import grader_server
from tests.test_training_e2e import celery_worker, training_settings  # noqa: F401 - the fixture

SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
COMPANIES = ["ACME", "Globex", "Initech", "Umbrella", "Hooli", "Stark", "Wayne", "Wonka", "Tyrell", "Cyberdyne"]


def browsing_row(company: str, year: int) -> dict:
    """Search, read the result, answer: the shape of an agent's trace."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": f"{company} revenue {year}"})}}
    revenue = f"${len(company) * 3 + year % 10}.{year % 7} million"
    return {"tools": [SEARCH], "messages": [
        {"role": "system", "content": "You answer questions about company reports. Search before you answer."},
        {"role": "user", "content": f"What was {company}'s revenue in {year}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"{company} {year} annual report: revenue {revenue}."},
        {"role": "assistant", "content": f"{company}'s revenue in {year} was {revenue}."},
    ]}


def upload(sdk: openai.OpenAI, rows: list[dict], name: str) -> str:
    return sdk.files.create(file=(name, io.BytesIO(jsonl(rows))), purpose="fine-tune").id


# The chain on the real model (supervised, an eval of two models, reinforcement, DPO) takes about
# 2 minutes alone and up to 5 beside the suite's other heavy tests on 2 cores.
@pytest.mark.timeout(600)
def test_a_supervised_job_lowers_its_validation_loss_and_serves(training_settings: Settings, project):  # noqa: ANN001, F811
    token = training_settings.worker_token.get_secret_value()
    with agent_rft_inference(training_settings, token=token) as (inference, _, _):
        training_settings.inference_url = inference
        with live_server(training_settings) as base, \
                openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
                celery_worker(training_settings, base) as (_, log):
            train = upload(sdk, [browsing_row(c, 2020 + i % 4) for i, c in enumerate(COMPANIES[:8])], "train.jsonl")
            valid = upload(sdk, [browsing_row(c, 2024) for c in COMPANIES[8:]], "valid.jsonl")
            job = sdk.fine_tuning.jobs.create(
                model="SmolLM2-135M-Instruct", training_file=train, validation_file=valid, seed=3, suffix="sft",
                method={"type": "supervised", "supervised": {
                    "hyperparameters": {"batch_size": 4, "n_epochs": 2},
                    "x_open_model": {"lora_rank": 8, "learning_rate": 1e-3, "eval_interval": 1}}})
            wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed"), timeout=600,
                     interval=1.0)
            done = sdk.fine_tuning.jobs.retrieve(job.id)
            assert done.status == "succeeded", (done.error, log.read_text()[-3000:])
            events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=100))
            checkpoints = list(sdk.fine_tuning.jobs.checkpoints.list(job.id))
            answer = sdk.chat.completions.create(model=done.fine_tuned_model, tools=[SEARCH], max_tokens=40,
                                                 temperature=0, messages=browsing_row("Hooli", 2024)["messages"][:2],
                                                 tool_choice={"type": "function", "function": {"name": "search"}})
            runs, items, tool_calls, grader_calls = evaluate_from(sdk, done.fine_tuned_model, log)
            rl_job, rl_events, rollouts = reinforce_from(sdk, done.fine_tuned_model, log)
            dpo_job, dpo_metrics, dpo_answer = prefer_from(sdk, done.fine_tuned_model, log)
            other = make_project(training_settings)
            with openai.OpenAI(base_url=f"{base}/v1", api_key=other["key"], max_retries=0) as outsider:
                for model in (done.fine_tuned_model, dpo_job.fine_tuned_model):  # another project's: as unknown
                    with pytest.raises(openai.NotFoundError):
                        outsider.fine_tuning.jobs.create(model=model, training_file=train)
    assert done.method.type == "supervised" and done.hyperparameters.batch_size == 4
    assert done.hyperparameters.learning_rate_multiplier == 1.0  # "auto", resolved
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(0 < m["train_mean_token_accuracy"] <= 1 for m in metrics)
    # Learning, with a margin: the held-out traces' loss falls by a quarter or more in 4 steps.
    assert metrics[-1]["valid_loss"] < 0.75 * metrics[0]["valid_loss"], [m["valid_loss"] for m in metrics]
    assert metrics[-1]["full_valid_loss"] == metrics[-1]["valid_loss"]  # 2 validation rows: the subset is all
    assert {c.step_number for c in checkpoints} >= {4}
    # The fine-tuned model is served with tools: a call (forced by name, so whatever the weights
    # favour) comes back in OpenAI's shape.
    assert answer.choices[0].finish_reason == "tool_calls", answer.choices[0].message
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "search" and isinstance(json.loads(call.function.arguments), dict)
    # An eval of the base model and the fine-tuned one, each item a rollout against the tool server:
    # the fine-tuned model searches (the base never does), and every tool call and grader call of an
    # item carries that item's trace id; the output items hold the trajectory.
    assert [r.status for r in runs] == ["completed", "completed"], [r.error for r in runs]
    base_items, tuned_items = items
    assert sum(len(i.model_extra["x_trajectory"]["tool_calls"]) for i in tuned_items) > 0
    tuned_traces = {i.model_extra["x_trace_id"]: i for i in tuned_items}
    assert len(tuned_traces) == len(tuned_items) == 2
    for trace_id, item in tuned_traces.items():
        calls = [c for c in tool_calls if c["body"]["trace_id"] == trace_id]
        assert len(calls) == len(item.model_extra["x_trajectory"]["tool_calls"])
        assert [c["body"]["name"] for c in calls] == [c["name"] for c in item.model_extra["x_trajectory"]["tool_calls"]]
    assert {c["body"]["trace_id"] for c in tool_calls} <= set(tuned_traces) | {
        i.model_extra["x_trace_id"] for i in base_items}
    all_traces = sorted([*tuned_traces, *(i.model_extra["x_trace_id"] for i in base_items)])
    assert sorted(g["trace_id"] for g in grader_calls) == all_traces  # one grader call per item
    assert all(i.model_extra["x_trajectory"]["messages"][0]["role"] == "system" for i in base_items + tuned_items)
    # Reinforcement from the supervised model: it samples with the adapter SFT trained (it calls the
    # tool, which the base model never does) and names the base model under it.
    assert rl_job.status == "succeeded", rl_job.error
    assert any(e.message.startswith(f"Starting from {done.fine_tuned_model} (SmolLM2-135M-Instruct): its LoRA "
                                    "adapter, trained on") for e in rl_events)
    assert rl_job.fine_tuned_model.startswith("ft:SmolLM2-135M-Instruct:")
    # Learning: the base model never calls the tool unprompted; after SFT on search traces, sampled
    # rollouts do.
    assert sum(r["tool_calls"] for r in rollouts) > 0, rollouts
    # The job's response_format left those calls free (a policy trained on browsing traces calls until
    # its budget ends); where it answers, the answer is JSON that fits, the graders' output_json.
    answered = [r for r in rollouts if r["finish_reason"] == "answered"]
    for rollout in answered:
        value = json.loads(rollout["data"]["final_answer"])
        jsonschema.validate(value, ANSWER_SCHEMA)
        assert rollout["data"]["output_json"] == value
    # DPO from the supervised model: answering once the search result holds the figure is preferred
    # to searching again. Held out, the policy's implicit reward picks the preferred answer and its
    # own log-prob margin for it grows; the DPO model serves.
    assert dpo_job.status == "succeeded" and dpo_job.method.dpo.hyperparameters.beta == 0.1  # "auto", resolved
    evaluated = [m for m in dpo_metrics if "valid_loss" in m]
    assert evaluated[0]["valid_loss"] < 0.6931 and evaluated[-1]["valid_loss"] < evaluated[0]["valid_loss"]
    assert evaluated[-1]["valid_preference_accuracy"] > 0.8, evaluated
    assert evaluated[-1]["valid_logprob_margin"] > evaluated[0]["valid_logprob_margin"], evaluated
    assert dpo_answer.choices[0].message.content or dpo_answer.choices[0].message.tool_calls


# The answer's format in the reinforcement job: strict, bounded so that an answer fits in a turn.
ANSWER_SCHEMA = {"type": "object", "properties": {"company": {"type": "string", "maxLength": 16}},
                 "required": ["company"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}


def prefer_from(sdk: openai.OpenAI, model: str, log) -> tuple:  # noqa: ANN001
    """A DPO job from `model` on pairs made from two-call traces (preference_pairs: the answer after
    the first result over a second search), and a chat completion of its fine-tuned model."""
    def traces(companies: list[str], year: int) -> list[dict]:
        out = []
        for company in companies:
            messages = browsing_row(company, year)["messages"]
            again = {"id": "call_2", "type": "function",
                     "function": {"name": "search", "arguments": json.dumps({"query": f"{company} report {year}"})}}
            out.append({"tools": [SEARCH], "messages": [
                *messages[:4], {"role": "assistant", "content": None, "tool_calls": [again]},
                {"role": "tool", "tool_call_id": "call_2", "content": messages[3]["content"]}, messages[4]]})
        return out

    train = upload(sdk, preference_pairs(traces(COMPANIES[:8], 2022)), "pairs.jsonl")
    valid = upload(sdk, preference_pairs(traces(COMPANIES[8:], 2025) + traces(COMPANIES[:3], 2019)), "vpairs.jsonl")
    job = sdk.fine_tuning.jobs.create(model=model, training_file=train, validation_file=valid, seed=7, method={
        "type": "dpo", "dpo": {"hyperparameters": {"batch_size": 4, "n_epochs": 1},
                               "x_open_model": {"eval_interval": 1}}})
    wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed"), timeout=600,
             interval=1.0)
    done = sdk.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded", (done.error, log.read_text()[-3000:])
    events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    answer = sdk.chat.completions.create(model=done.fine_tuned_model, tools=[SEARCH], max_tokens=30, temperature=0,
                                         messages=traces(["Hooli"], 2024)[0]["messages"][:4])
    return done, metrics, answer


def evaluate_from(sdk: openai.OpenAI, model: str, log) -> tuple:  # noqa: ANN001
    """An eval (a string check and an endpoint grader) run on the base model and on `model`, with
    the search tool's endpoint: each held-out question is a rollout, as in training."""
    questions = [{"messages": browsing_row(c, 2024)["messages"][:2], "company": c} for c in COMPANIES[8:]]
    with tool_server() as (tool_url, tools), grader_server() as (grader_url, graded):
        evaluation = sdk.evals.create(name="held out", data_source_config={
            "type": "custom", "item_schema": {"type": "object", "properties": {"company": {"type": "string"}}}},
            testing_criteria=[{"type": "string_check", "name": "named", "input": "{{sample.output_text}}",
                               "reference": "{{item.company}}", "operation": "like"},
                              {"type": "endpoint", "name": "judge", "url": grader_url}])
        runs = [sdk.evals.runs.create(evaluation.id, name=name, data_source={
            "type": "completions", "model": name, "input_messages": {"type": "item_reference",
                                                                     "item_reference": "item.messages"},
            "source": {"type": "file_content", "content": [{"item": q} for q in questions]},
            "sampling_params": {"temperature": 0.7, "max_completion_tokens": 40, "tools": [SEARCH]},
            "x_open_model": {"tools": [{"name": "search", "server_url": tool_url}], "max_episode_steps": 2,
                             "max_tokens_per_rollout": 80}}) for name in ("SmolLM2-135M-Instruct", model)]
        for run in runs:
            wait_for(lambda r=run: sdk.evals.runs.retrieve(r.id, eval_id=evaluation.id).status in (
                "completed", "failed", "canceled"), timeout=300, interval=1.0)
        done = [sdk.evals.runs.retrieve(r.id, eval_id=evaluation.id) for r in runs]
        assert all(r.status == "completed" for r in done), ([r.error for r in done], log.read_text()[-3000:])
        items = [list(sdk.evals.runs.output_items.list(r.id, eval_id=evaluation.id)) for r in runs]
        return done, items, list(tools.calls), list(graded)


def reinforce_from(sdk: openai.OpenAI, model: str, log) -> tuple:  # noqa: ANN001
    """One reinforcement step from `model` on the same questions, with a search tool that answers and
    a JSON answer format (tool calls stay free; the answer is constrained on the in-process engine)."""
    rows = [{"messages": browsing_row(c, 2023)["messages"][:2], "tools": [SEARCH], "reference_answer": c}
            for c in COMPANIES[:2]]
    with tool_server() as (tool_url, _):
        job = sdk.fine_tuning.jobs.create(model=model, training_file=upload(sdk, rows, "rl.jsonl"), seed=5, method={
            "type": "reinforcement", "reinforcement": {
                "grader": {"type": "string_check", "name": "named", "input": "{{sample.output_text}}",
                           "reference": "{{item.reference_answer}}", "operation": "like"},
                "tools": [{"name": "search", "server_url": tool_url}],
                "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 1, "eval_interval": 1,
                                    "eval_samples": 1},
                "max_episode_steps": 2, "response_format": ANSWER_FORMAT,
                "x_open_model": {"max_tokens_per_turn": 40, "max_tokens_per_rollout": 80, "temperature": 0.7,
                                 "sampler": "engine"}}})
        wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed"), timeout=600,
                 interval=1.0)
    done = sdk.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded", (done.error, log.read_text()[-3000:])
    events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=100))
    rollouts = sdk.get(f"/fine_tuning/jobs/{job.id}/rollouts", cast_to=object)["data"]
    return done, events, rollouts
