"""Fuzzing: schemathesis generates requests for every /v1 operation of the OpenAPI
schema the live app serves, valid ones and invalid ones, with real ids in the paths, and no
answer may be a 5xx. Bounded: MAX_EXAMPLES per operation and mode, no shrinking (the first
failing request of each operation is reported as a curl command), about a minute in all."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings as hypothesis_settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.errors import UnsupportedSchema

from app.core.config import Settings
from tests.conftest import job_body, jsonl, live_server, question_rows, wait_for

# Per operation and run; AGENT_RFT_FUZZ_EXAMPLES=500 fuzzes deeper by hand (minutes, not seconds).
MAX_EXAMPLES = int(os.environ.get("AGENT_RFT_FUZZ_EXAMPLES", "25"))
BASE_MODEL = "SmolLM2-135M-Instruct"
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
DIAGNOSTICS = "/v1/fine_tuning/alpha/diagnostics"


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def real_ids(http: httpx.Client, worker: httpx.Client, settings: Settings) -> dict[str, str]:
    """One real object for every path parameter: a file, a job with a checkpoint (pushed through
    the worker API, its files on disk), a diagnostic, a webhook endpoint with a delivery, a model."""
    file_id = _ok(http.post("/v1/files", files={"file": ("train.jsonl", jsonl(question_rows(3)))},
                            data={"purpose": "fine-tune"}))["id"]
    endpoint = _ok(http.post("/v1/webhook_endpoints", json={
        "name": "fuzz", "url": "http://127.0.0.1:9/hook", "event_types": ["fine_tuning.job.cancelled"]}))["id"]
    job = _ok(http.post("/v1/fine_tuning/jobs", json=job_body(file_id)))["id"]
    wait_for(lambda: http.get(f"/v1/fine_tuning/jobs/{job}").json()["status"] == "queued")
    lease = _ok(worker.post(f"/internal/v1/jobs/{job}/claim", json={"worker_id": "fuzz"}))["lease_id"]
    checkpoint_dir = Path(settings.resolved_checkpoint_dir) / job / "step-1"
    checkpoint_dir.mkdir(parents=True)
    (checkpoint_dir / "adapter_config.json").write_text("{}")
    checkpoint = _ok(worker.put(f"/internal/v1/jobs/{job}/checkpoints/1", json={
        "lease_id": lease, "path": str(checkpoint_dir), "metrics": {"valid_reward_mean": 0.5}}))["id"]
    cancelled = _ok(http.post("/v1/fine_tuning/jobs", json=job_body(file_id)))["id"]
    _ok(http.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel"))
    delivery = wait_for(lambda: http.get(f"/v1/webhook_endpoints/{endpoint}/deliveries").json()["data"])[0]["id"]
    diagnostic = _ok(http.post(DIAGNOSTICS, json=job_body(file_id)))["id"]
    model = _ok(http.get(f"/v1/fine_tuning/jobs/{job}/checkpoints"))["data"][0]["fine_tuned_model_checkpoint"]
    return {"file_id": file_id, "fine_tuning_job_id": job, "checkpoint_id": checkpoint, "diagnostic_id": diagnostic,
            "webhook_endpoint_id": endpoint, "delivery_id": delivery, "model": model}


def fuzzed(operation: Any) -> bool:
    """Every /v1 operation; none starts heavy work here: a job it creates is queued to a Redis list
    that no worker reads, and chat completions find no inference server (503, allowed below).
    Left out: /internal/v1, the workers' API (its own token and leases; tests/test_internal.py)."""
    return operation.path.startswith("/v1/")


# The 5xx answers that are documented here: the model endpoints with no inference server running
# (503 `inference_unavailable`, docs/serving.md; the fixture app starts none, since loading a model
# is the inference server's own tests' business), and tool/run's answer for a tool that is not there.
EXPECTED_5XX = {"/v1/chat/completions": {(503, "inference_unavailable")},
                "/v1/responses": {(503, "inference_unavailable")},
                "/v1/fine_tuning/alpha/tool/run": {(502, "tool_unavailable"), (504, "tool_timeout")}}


def expected_5xx(operation: Any, response: Any) -> bool:
    allowed = EXPECTED_5XX.get(operation.path, set())
    return response.status_code >= 500 and (response.status_code, response.json()["error"]["code"]) in allowed


def order(operation: Any) -> tuple[int, str]:
    """Deletes last, so that the other operations meet the real objects."""
    return (operation.method.upper() == "DELETE", operation.label)


def realistic(case: Any, ids: dict[str, str]) -> None:
    """A valid case made likelier to get past the first check: the body's file ids, base model and
    webhook URL replaced by real ones, so that the generated rest reaches the services."""
    if not isinstance(case.body, dict):
        return
    for key, value in (("training_file", ids["file_id"]), ("validation_file", ids["file_id"]),
                       ("model", BASE_MODEL), ("url", "http://127.0.0.1:9/hook")):
        if isinstance(case.body.get(key), str):
            case.body[key] = value


def with_nul(case: Any) -> None:
    """The case with a NUL in its first string query parameter or top-level body field: a byte
    Hypothesis draws too seldom for a bounded run to meet, and the one PostgreSQL cannot store."""
    for container in (case.query, case.body):
        if isinstance(container, dict):
            key = next((k for k, v in container.items() if isinstance(v, str)), None)
            if key is not None:
                container[key] += "\x00"
                return


def fuzz(operation: Any, mode: GenerationMode, *, base: str, ids: dict[str, str] | None,
         headers: dict[str, str]) -> str | None:
    """The first request of `mode` that drew a 5xx, as a curl command, or None. With `ids`, path
    parameters are real ids and valid bodies realistic; without, everything is generated."""
    found: list[str] = []
    drawn = itertools.count(1)
    path_parameters = {p.name: ids[p.name] for p in operation.path_parameters if p.name in ids} if ids else None

    @hypothesis_settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters, headers=headers))
    def run(case: Any) -> None:
        if found:
            return
        if ids and mode is GenerationMode.POSITIVE:
            realistic(case, ids)
        if next(drawn) % 3 == 0:  # every third case
            with_nul(case)
        response = case.call(base_url=base, timeout=30)
        if response.status_code >= 500 and not expected_5xx(operation, response):
            found.append(f"{response.status_code} {response.text[:300]}\n    {case.as_curl_command()}")

    try:
        run()
    except (Unsatisfiable, UnsupportedSchema):
        # Nothing left to make invalid (every parameter fixed, no body), or a part of the schema
        # schemathesis cannot negate (a `not` below the root); the cases drawn before still ran.
        assert mode is GenerationMode.NEGATIVE, operation.label
    return found[0] if found else None


def test_no_operation_answers_5xx(settings: Settings, project: dict[str, str]) -> None:
    """One test for all operations (one live app, one set of objects); it lists every failure."""
    headers = {"Authorization": f"Bearer {project['key']}"}
    worker_headers = {"Authorization": f"Bearer {settings.worker_token.get_secret_value()}"}
    with live_server(settings) as base, httpx.Client(base_url=base, headers=headers, timeout=30) as http, \
            httpx.Client(base_url=base, headers=worker_headers, timeout=30) as worker:
        ids = real_ids(http, worker, settings)
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        operations = sorted((op for op in (result.ok() for result in schema.get_all_operations()) if fuzzed(op)),
                            key=order)
        assert len(operations) >= 35, [op.label for op in operations]
        failures, started = [], time.monotonic()
        for operation in operations:
            # Real ids first; then, where the path has parameters, generated ones (unknown ids, odd characters).
            runs = [(mode, ids) for mode in MODES] + ([(GenerationMode.POSITIVE, None)] if "{" in operation.path else [])
            for mode, run_ids in runs:
                failure = fuzz(operation, mode, base=base, ids=run_ids, headers=headers)
                if failure:
                    failures.append(f"{operation.label} ({mode.value}{'' if run_ids else ', generated ids'}): {failure}")
        elapsed = time.monotonic() - started
    assert not failures, "\n".join(failures)
    assert elapsed < 240 * MAX_EXAMPLES / 25, f"fuzzing took {elapsed:.0f} s"
