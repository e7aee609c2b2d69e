"""Adding a training method is a module per side and a line in each registry: the test-only method
`imitate` (tests/plugin_method/) runs a job end to end through the openai SDK and a real worker on
the tiny model; without its registry line the API refuses its type."""

from __future__ import annotations

import io
import os

import openai
import pytest

import app.jobs.methods
from tests.conftest import REPO, jsonl, live_server, wait_for
from tests.plugin_method import api as imitate_api
from tests.test_training_e2e import celery_worker, training_settings  # noqa: F401 - the fixture

ROWS = [{"text": f"The code of item {i} is {i * 7 % 10}{i * 3 % 10}."} for i in range(6)]


def test_a_method_added_to_both_registries_trains_a_job_end_to_end(training_settings, project,  # noqa: F811
                                                                  monkeypatch):
    with live_server(training_settings) as base, \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk:
        train = sdk.files.create(file=("t.jsonl", io.BytesIO(jsonl(ROWS))), purpose="fine-tune").id
        valid = sdk.files.create(file=("v.jsonl", io.BytesIO(jsonl(ROWS[:2]))), purpose="fine-tune").id
        body = {"model": "tiny-smollm2", "training_file": train, "validation_file": valid, "seed": 1,
                "method": {"type": "imitate", "imitate": {"n_epochs": 2, "learning_rate": 3e-2}}}
        with pytest.raises(openai.BadRequestError) as unknown:
            sdk.fine_tuning.jobs.create(**body)
        assert unknown.value.param == "method.type" and unknown.value.code == "unsupported_method"

        monkeypatch.setitem(app.jobs.methods.METHODS, imitate_api.TYPE, imitate_api)  # the API's registry line
        path = os.pathsep.join([str(REPO / "tests" / "plugin_method" / "registered"), str(REPO),
                                os.environ.get("PYTHONPATH", "")])
        with celery_worker(training_settings, base, extra_env={"PYTHONPATH": path}) as (_, log):  # the workers'
            job = sdk.fine_tuning.jobs.create(**body)
            wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed"), timeout=300,
                     interval=0.5)
            done = sdk.fine_tuning.jobs.retrieve(job.id)
            assert done.status == "succeeded", (done.error, log.read_text()[-3000:])
        events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=100))
        checkpoints = list(sdk.fine_tuning.jobs.checkpoints.list(job.id))
        bad = sdk.files.create(file=("b.jsonl", io.BytesIO(jsonl([ROWS[0], {"text": ""}]))), purpose="fine-tune").id
        refused = sdk.fine_tuning.jobs.create(**{**body, "training_file": bad})
        failed = wait_for(lambda: (j := sdk.fine_tuning.jobs.retrieve(refused.id)).status == "failed" and j)
    assert done.method.type == "imitate" and done.fine_tuned_model.startswith("ft:tiny-smollm2:")
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda d: d["step"])
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] and metrics[-1]["valid_loss"] < metrics[0]["valid_loss"]
    assert {c.step_number for c in checkpoints} >= {6}
    assert failed.error.code == "missing_text" and "line 2" in failed.error.message  # its own row rule
