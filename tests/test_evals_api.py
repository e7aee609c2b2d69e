"""`/v1/evals` through the `openai` SDK, without a worker: evals created, read, updated, listed and
deleted; runs created, listed, cancelled and deleted; what is refused (a 400 naming its param) and
what another project cannot see (404). Runs executed by a worker: tests/test_evals_e2e.py."""

from __future__ import annotations

import io

import openai
import pytest

from app.core.config import Settings
from tests.conftest import job_body, jsonl, live_server, make_project, question_rows

ITEM_SCHEMA = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
               "required": ["question", "answer"]}
STRING_CHECK = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}", "operation": "eq"}
ENDPOINT = {"type": "endpoint", "name": "judge", "url": "http://127.0.0.1:9/grade",
            "headers": {"Authorization": "Bearer grader-secret-abcdef123456"}}
TEMPLATE = {"type": "template", "template": [{"role": "system", "content": "Answer with a number."},
                                             {"role": "user", "content": "{{item.question}}"}]}
ITEMS = [{"item": {"question": f"What is {i} + {i}?", "answer": str(2 * i)}} for i in range(3)]


@pytest.fixture
def sdk(settings: Settings, project: dict[str, str]):  # noqa: ANN201
    with live_server(settings) as base, openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"],
                                                      max_retries=0) as client:
        client.base = base
        yield client


def make_eval(sdk: openai.OpenAI, **overrides) -> object:  # noqa: ANN003
    body = {"name": "arithmetic", "data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA,
                                                         "include_sample_schema": True},
            "testing_criteria": [STRING_CHECK, ENDPOINT], "metadata": {"team": "agents"}, **overrides}
    return sdk.evals.create(**body)


def completions_source(**overrides) -> dict:  # noqa: ANN003
    return {"type": "completions", "model": "tiny-smollm2", "input_messages": TEMPLATE,
            "source": {"type": "file_content", "content": ITEMS}, "sampling_params": {"temperature": 0.5}, **overrides}


def test_an_eval_is_created_read_updated_listed_and_deleted_with_its_grader_secrets_masked(sdk):
    created = make_eval(sdk)
    assert created.id.startswith("eval_") and created.object == "eval" and created.name == "arithmetic"
    schema = created.data_source_config.schema_
    assert schema["properties"]["item"] == ITEM_SCHEMA and "sample" in schema["properties"]
    names = [c["name"] if isinstance(c, dict) else c.name for c in created.testing_criteria]
    assert names == ["exact", "judge"]
    raw = sdk.get(f"/evals/{created.id}", cast_to=dict)
    assert raw["testing_criteria"][1]["headers"] == {"Authorization": "****3456"}  # never echoed
    assert sdk.evals.retrieve(created.id).metadata == {"team": "agents"}
    renamed = sdk.evals.update(created.id, name="sums", metadata={"team": "evals"})
    assert (renamed.name, renamed.metadata) == ("sums", {"team": "evals"})
    second = make_eval(sdk, name="second")
    assert [e.id for e in sdk.evals.list(order="asc")] == [created.id, second.id]
    assert [e.id for e in sdk.evals.list(order="desc", limit=1).data] == [second.id]
    deleted = sdk.evals.delete(created.id)
    assert deleted.deleted and deleted.eval_id == created.id
    with pytest.raises(openai.NotFoundError):
        sdk.evals.retrieve(created.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"data_source_config": {"type": "logs"}}, "data_source_config.type"),
    ({"data_source_config": {"type": "custom", "item_schema": "object"}}, "data_source_config.item_schema"),
    ({"testing_criteria": [{"type": "string_check", "name": "x", "input": "{{sample.output_text}}"}]},
     "testing_criteria[0].reference"),
    ({"testing_criteria": [STRING_CHECK, STRING_CHECK]}, "testing_criteria"),
    ({"testing_criteria": [{**ENDPOINT, "url": "http://10.1.2.3/grade"}]}, "testing_criteria[0].url"),
])
def test_a_bad_eval_is_a_400_naming_its_param(sdk, body, param):
    with pytest.raises(openai.BadRequestError) as raised:
        make_eval(sdk, **body)
    assert raised.value.body["param"] == param, raised.value.body


def test_runs_are_created_listed_cancelled_and_deleted_and_their_tool_secrets_masked(sdk):
    evaluation = make_eval(sdk)
    tools = [{"name": "search", "server_url": "http://127.0.0.1:9/tools",
              "headers": {"Authorization": "Bearer tool-secret-abcdef123456"}}]
    run = sdk.evals.runs.create(evaluation.id, name="base", data_source=completions_source(),
                                extra_body={"metadata": {"k": "v"}})
    agent = sdk.evals.runs.create(evaluation.id, name="agent", data_source=completions_source(
        x_open_model={"tools": tools, "max_episode_steps": 3, "samples_per_item": 2}))
    assert run.id.startswith("evalrun_") and run.object == "eval.run" and run.eval_id == evaluation.id
    assert (run.status, run.model, run.name, run.result_counts.total) == ("queued", "tiny-smollm2", "base", 0)
    raw = sdk.get(f"/evals/{evaluation.id}/runs/{agent.id}", cast_to=dict)
    assert raw["data_source"]["x_open_model"]["tools"][0]["headers"] == {"Authorization": "****3456"}
    assert raw["x_items_total"] == 6  # 3 items x 2 samples
    assert [r.id for r in sdk.evals.runs.list(evaluation.id)] == [run.id, agent.id]
    cancelled = sdk.evals.runs.cancel(agent.id, eval_id=evaluation.id)
    assert cancelled.status == "canceled"
    assert [r.id for r in sdk.evals.runs.list(evaluation.id, status="canceled")] == [agent.id]
    with pytest.raises(openai.ConflictError):  # a canceled run stays canceled
        sdk.evals.runs.cancel(agent.id, eval_id=evaluation.id)
    assert sdk.evals.runs.delete(run.id, eval_id=evaluation.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.evals.runs.retrieve(run.id, eval_id=evaluation.id)
    assert list(sdk.evals.runs.output_items.list(agent.id, eval_id=evaluation.id)) == []


@pytest.mark.parametrize(("data_source", "param"), [
    ({"type": "completions", "model": "tiny-smollm2", "input_messages": TEMPLATE,
      "source": {"type": "stored_completions"}}, "data_source.source.type"),
    ({"type": "completions", "model": "tiny-smollm2", "source": {"type": "file_content", "content": ITEMS}},
     "data_source.input_messages"),
    (completions_source(source={"type": "file_id", "id": "file-nope"}), "data_source.source.id"),
    (completions_source(input_messages={"type": "template", "template": [{"role": "user", "content": "{{x.y}}"}]}),
     "data_source.input_messages.template[0].content"),
    (completions_source(input_messages={"type": "template", "template": [{"role": "robot", "content": "hi"}]}),
     "data_source.input_messages.template[0].role"),
    (completions_source(sampling_params={"temperature": 3}), "data_source.sampling_params.temperature"),
    (completions_source(sampling_params={"response_format": {"type": "json_schema"}}),
     "data_source.sampling_params.response_format"),
    (completions_source(x_open_model={"tools": [{"name": "search", "server_url": "http://10.0.0.8/tools"}]}),
     "data_source.x_open_model.tools[0].server_url"),
    ({"type": "jsonl", "source": {"type": "file_content", "content": ITEMS}}, "data_source.source.content[0].sample"),
    ({"type": "logs", "source": {"type": "file_content", "content": ITEMS}}, "data_source.type"),
])
def test_a_bad_data_source_is_a_400_naming_its_param(sdk, data_source, param):
    evaluation = make_eval(sdk)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.evals.runs.create(evaluation.id, data_source=data_source)
    assert raised.value.body["param"] == param, raised.value.body


def test_a_run_on_another_projects_model_file_or_eval_is_a_404(sdk, settings):
    mine = make_eval(sdk)
    run = sdk.evals.runs.create(mine.id, data_source=completions_source())
    other = make_project(settings)
    with openai.OpenAI(base_url=f"{sdk.base}/v1", api_key=other["key"], max_retries=0) as outsider:
        with pytest.raises(openai.NotFoundError):
            outsider.evals.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            outsider.evals.runs.retrieve(run.id, eval_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            outsider.evals.runs.output_items.list(run.id, eval_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            outsider.evals.delete(mine.id)
        theirs = make_eval(outsider)
        with pytest.raises(openai.NotFoundError):  # a fine-tuned model the project does not have
            outsider.evals.runs.create(theirs.id, data_source=completions_source(model="ft:tiny-smollm2:x:y:z"))
        file_id = sdk.files.create(file=("items.jsonl", io.BytesIO(jsonl(ITEMS))), purpose="fine-tune").id
        with pytest.raises(openai.BadRequestError) as raised:  # another project's file: no such file here
            outsider.evals.runs.create(theirs.id, data_source=completions_source(
                source={"type": "file_id", "id": file_id}))
        assert raised.value.body["param"] == "data_source.source.id"
    assert sdk.evals.retrieve(mine.id).id == mine.id  # untouched


def test_an_eval_from_a_job_needs_a_succeeded_job_of_the_project(sdk, settings):
    training = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(question_rows()))), purpose="fine-tune").id
    job = sdk.fine_tuning.jobs.create(**job_body(training))
    with pytest.raises(openai.ConflictError) as raised:  # not succeeded: no final model to compare
        sdk.post(f"/evals/x_from_job/{job.id}", cast_to=dict, body={})
    assert raised.value.body["param"] == "job_id"
    with pytest.raises(openai.NotFoundError):
        sdk.post("/evals/x_from_job/ftjob-nope", cast_to=dict, body={})
    other = make_project(settings)
    with openai.OpenAI(base_url=f"{sdk.base}/v1", api_key=other["key"], max_retries=0) as outsider:
        with pytest.raises(openai.NotFoundError):
            outsider.post(f"/evals/x_from_job/{job.id}", cast_to=dict, body={})
