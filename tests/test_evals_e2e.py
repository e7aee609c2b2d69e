"""Eval runs executed by a real Celery worker through the `openai` SDK, on the tiny model: given
samples (`jsonl`) graded by a string check and a real endpoint grader, a model run with samples per
item, a cancel mid-run, and the comparison of two runs. A tool-using run on a fine-tuned model:
tests/test_supervised_e2e.py."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
from fastapi import FastAPI, Request

from app.core.config import Settings
from tests.conftest import live_server, serve_app, wait_for
from tests.test_evals_api import ITEM_SCHEMA, STRING_CHECK, TEMPLATE
from tests.test_training_e2e import celery_worker, training_settings  # noqa: F401 - the fixture

FINAL = ("completed", "failed", "canceled")
AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")


@contextmanager
def grader_server(score: float = 0.75) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An endpoint grader (docs/grader-endpoint.md) that records each request's body and headers."""
    app, seen, lock = FastAPI(), [], threading.Lock()

    @app.post("/grade")
    async def grade(request: Request) -> dict[str, float]:
        body = await request.json()
        with lock:
            seen.append({**body, "headers": dict(request.headers)})
        return {"score": score}

    with serve_app(app) as port:
        yield f"http://127.0.0.1:{port}/grade", seen


def finished(sdk: openai.OpenAI, eval_id: str, run_id: str, timeout: float = 240) -> Any:
    wait_for(lambda: sdk.evals.runs.retrieve(run_id, eval_id=eval_id).status in FINAL, timeout=timeout, interval=0.5)
    return sdk.evals.runs.retrieve(run_id, eval_id=eval_id)


def output_items(sdk: openai.OpenAI, eval_id: str, run_id: str) -> list[Any]:
    return list(sdk.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=100))


def test_given_samples_and_a_model_run_are_graded_by_every_criterion_on_a_worker(training_settings: Settings,  # noqa: F811
                                                                                 project):  # noqa: ANN001
    items = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    given = [{"item": item, "sample": {"output_text": item["answer"] if i % 2 == 0 else "no idea"}}
             for i, item in enumerate(items)]
    with grader_server() as (grader_url, graded), live_server(training_settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        evaluation = sdk.evals.create(
            name="sums", data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA},
            testing_criteria=[STRING_CHECK, {"type": "endpoint", "name": "judge", "url": grader_url,
                                             "headers": {"Authorization": "Bearer grader-secret-abcdef123456"}}])
        jsonl_run = sdk.evals.runs.create(evaluation.id, name="given", data_source={
            "type": "jsonl", "source": {"type": "file_content", "content": given}})
        model_run = sdk.evals.runs.create(evaluation.id, name="tiny", data_source={
            "type": "completions", "model": "tiny-smollm2", "input_messages": TEMPLATE,
            "source": {"type": "file_content", "content": [{"item": item} for item in items]},
            "sampling_params": {"temperature": 1.0, "max_completion_tokens": 8, "seed": 5},
            "x_open_model": {"samples_per_item": 2}})
        long_run = sdk.evals.runs.create(evaluation.id, name="to cancel", data_source={
            "type": "completions", "model": "tiny-smollm2", "input_messages": TEMPLATE,
            "source": {"type": "file_content", "content": [{"item": items[0]}] * 200},
            "sampling_params": {"max_completion_tokens": 64}})
        done_jsonl = finished(sdk, evaluation.id, jsonl_run.id)
        done_model = finished(sdk, evaluation.id, model_run.id)
        wait_for(lambda: sdk.evals.runs.retrieve(long_run.id, eval_id=evaluation.id).status == "in_progress",
                 timeout=120, interval=0.2)
        sdk.evals.runs.cancel(long_run.id, eval_id=evaluation.id)
        after_cancel = sdk.evals.runs.retrieve(long_run.id, eval_id=evaluation.id)
        jsonl_items = output_items(sdk, evaluation.id, jsonl_run.id)
        model_items = output_items(sdk, evaluation.id, model_run.id)
        one = sdk.evals.runs.output_items.retrieve(model_items[0].id, eval_id=evaluation.id, run_id=model_run.id)
        failing = list(sdk.evals.runs.output_items.list(jsonl_run.id, eval_id=evaluation.id, status="fail"))
        comparison = sdk.get(f"/evals/{evaluation.id}/x_compare", cast_to=dict,
                             options={"params": {"run_ids": [jsonl_run.id, model_run.id]}})
        csv_path = training_settings.data_dir / "comparison.csv"
        printed = subprocess.run([AGENT_RFT, "evals", "compare", evaluation.id, jsonl_run.id, model_run.id,
                                  "--csv", str(csv_path), "--per-item", "--base-url", f"{base}/v1"],
                                 env={**os.environ, "AGENT_RFT_API_KEY": project["key"]}, capture_output=True,
                                 text=True, timeout=60, check=False)
        # The worker is free again after the cancel: another run completes.
        again = finished(sdk, evaluation.id, sdk.evals.runs.create(evaluation.id, data_source={
            "type": "jsonl", "source": {"type": "file_content", "content": given[:1]}}).id)
    assert done_jsonl.status == "completed", (done_jsonl.error, log.read_text()[-3000:])
    # Given samples: the even items answered right pass the string check; the judge scores all 0.75.
    assert done_jsonl.result_counts.model_dump() == {"total": 4, "passed": 2, "failed": 2, "errored": 0}
    per_criterion = {r.testing_criteria: (r.passed, r.failed) for r in done_jsonl.per_testing_criteria_results}
    assert per_criterion == {"exact": (2, 2), "judge": (4, 0)}
    assert sorted(i.datasource_item_id for i in jsonl_items) == [0, 1, 2, 3]
    for item in jsonl_items:
        by_name = {r.name: r for r in item.results}
        assert by_name["exact"].passed == (item.datasource_item_id % 2 == 0)
        assert by_name["judge"].score == 0.75 and by_name["judge"].passed
        assert item.status == ("pass" if item.datasource_item_id % 2 == 0 else "fail")
    # Every endpoint-grader call carried its item's trace id, and the criterion's secret header.
    assert sorted(g["trace_id"] for g in graded[:4]) == sorted(i.model_extra["x_trace_id"] for i in jsonl_items)
    assert all(g["headers"]["authorization"] == "Bearer grader-secret-abcdef123456" for g in graded)
    # The model run: 4 items x 2 samples, each with OpenAI's sample and the rollout's record.
    assert done_model.status == "completed", (done_model.error, log.read_text()[-3000:])
    assert done_model.result_counts.total == 8 and len(model_items) == 8
    assert {(i.datasource_item_id, i.model_extra["x_sample_index"]) for i in model_items} == {
        (i, k) for i in range(4) for k in range(2)}
    for item in model_items:
        assert item.sample.model == "tiny-smollm2" and item.sample.temperature == 1.0
        assert [m.content for m in item.sample.input][1] == item.datasource_item["question"]
        assert item.sample.usage.completion_tokens > 0 and item.sample.finish_reason in ("stop", "length")
        assert item.model_extra["x_trajectory"]["messages"][1]["content"] == item.datasource_item["question"]
    assert one.model_dump() == model_items[0].model_dump()
    assert sorted(i.datasource_item_id for i in failing) == [1, 3]
    usage = done_model.per_model_usage[0]
    assert usage.run_model_name == "tiny-smollm2" and usage.invocation_count == 8
    assert usage.completion_tokens == sum(i.sample.usage.completion_tokens for i in model_items)
    # Cancelled mid-run: it stays cancelled, with what it graded so far.
    assert after_cancel.status == "canceled" and after_cancel.result_counts.total < 200
    assert again.status == "completed"
    # The comparison reads both runs item by item.
    assert [r["id"] for r in comparison["runs"]] == [jsonl_run.id, model_run.id]
    assert comparison["runs"][0]["pass_rate"] == 0.5 and len(comparison["items"]) == 4
    # ... and so does the command line, as a table and as CSV (a row per item).
    assert printed.returncode == 0, printed.stderr
    assert "given (baseline)" in printed.stdout and "tiny" in printed.stdout and "pass rate" in printed.stdout
    assert f"/dashboard/evals/{evaluation.id}/compare?runs={jsonl_run.id},{model_run.id}" in printed.stdout
    rows = list(csv.DictReader(csv_path.open()))
    assert [int(r["item_index"]) for r in rows] == [0, 1, 2, 3]
    assert all(r[f"{model_run.id}:quadrant"] for r in rows)


def test_a_run_whose_worker_is_killed_is_requeued_and_the_next_worker_grades_only_what_is_missing(
        training_settings: Settings, project):  # noqa: ANN001, F811
    items = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(80)]
    with live_server(training_settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        evaluation = sdk.evals.create(data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA},
                                      testing_criteria=[STRING_CHECK])
        with celery_worker(training_settings, base) as (worker, _):
            run = sdk.evals.runs.create(evaluation.id, data_source={
                "type": "completions", "model": "tiny-smollm2", "input_messages": TEMPLATE,
                "source": {"type": "file_content", "content": [{"item": item} for item in items]},
                "sampling_params": {"max_completion_tokens": 48, "seed": 3}})
            # Mid-run, no goodbye: the first chunk is stored, the rest is not.
            wait_for(lambda: 0 < sdk.evals.runs.retrieve(run.id, eval_id=evaluation.id).result_counts.total < 80,
                     timeout=120, interval=0.05)
            os.killpg(worker.pid, signal.SIGKILL)
        stored_before = sdk.evals.runs.retrieve(run.id, eval_id=evaluation.id).result_counts.total
        # The watchdog notices the silent lease and re-queues the run; the next worker carries on.
        wait_for(lambda: sdk.evals.runs.retrieve(run.id, eval_id=evaluation.id).status == "queued", timeout=60,
                 interval=0.2)
        with celery_worker(training_settings, base) as (_, log):
            done = finished(sdk, evaluation.id, run.id)
        stored = output_items(sdk, evaluation.id, run.id)
    assert done.status == "completed", (done.error, log.read_text()[-3000:])
    assert 0 < stored_before < 80
    assert sorted(i.datasource_item_id for i in stored) == list(range(80))  # each item graded once
    assert done.result_counts.total == 80


def test_bad_items_are_errored_output_items_and_a_bad_file_line_fails_the_run_naming_it(
        training_settings: Settings, project):  # noqa: ANN001, F811
    good = {"question": "What is 1 + 1?", "answer": "2"}
    with live_server(training_settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        evaluation = sdk.evals.create(data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA},
                                      testing_criteria=[STRING_CHECK])
        # OpenAI's purpose for an eval's items; the second line is not JSON.
        broken = sdk.files.create(file=("items.jsonl", b'{"item": {"question": "q", "answer": "a"}}\n{oops\n'),
                                  purpose="evals")
        bad_file = sdk.evals.runs.create(evaluation.id, data_source={
            "type": "jsonl", "source": {"type": "file_id", "id": broken.id}})
        # An item without its answer (the schema requires one), and one without the field the template names.
        template = {"type": "template", "template": [{"role": "user", "content": "{{item.question}} {{item.hint}}"}]}
        mixed = sdk.evals.runs.create(evaluation.id, data_source={
            "type": "completions", "model": "tiny-smollm2", "input_messages": template,
            "source": {"type": "file_content", "content": [
                {"item": {**good, "hint": "add"}}, {"item": {"question": "no answer", "hint": "x"}}, {"item": good}]},
            "sampling_params": {"max_completion_tokens": 8}})
        failed = finished(sdk, evaluation.id, bad_file.id)
        done = finished(sdk, evaluation.id, mixed.id)
        stored = {i.datasource_item_id: i for i in output_items(sdk, evaluation.id, mixed.id)}
    assert failed.status == "failed" and failed.error.code == "invalid_data_source", failed.error
    assert "line 2 is not JSON" in failed.error.message
    assert done.status == "completed", (done.error, log.read_text()[-3000:])
    assert done.result_counts.total == 3 and done.result_counts.errored == 2
    assert stored[0].status in ("pass", "fail") and stored[0].model_extra["x_trajectory"]
    assert stored[1].status == "error" and "item_schema" in stored[1].sample.error.message
    assert "answer" in stored[1].sample.error.message
    assert stored[2].status == "error" and "hint" in stored[2].sample.error.message
    assert all(r.score is None and not r.passed for r in stored[2].results)
