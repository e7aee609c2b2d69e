"""The evals commands of the command line, over the `openai` SDK: `agent-rft compare JOB` (an eval
from the job, one run per model it touched, the comparison) and `agent-rft evals compare`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai

from app.cli_client import CliError, Echo, api_errors, poll_until, upload_file
from app.evals.compare import format_comparison

FINAL = ("completed", "failed", "canceled")


def read_criteria(paths: list[Path]) -> list[dict[str, Any]]:
    criteria = []
    for path in paths:
        try:
            criteria.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise CliError(f"{path}: cannot read a testing criterion (a grader object as JSON): {exc}") from exc
    return criteria


def file_id_of(client: openai.OpenAI, file: str | None, echo: Echo) -> str | None:
    """A file id as given, or a local JSONL file uploaded (purpose fine-tune)."""
    if file is None or not Path(file).expanduser().is_file():
        return file
    uploaded = upload_file(client, Path(file).expanduser(), "fine-tune")
    echo(f"uploaded {file}: {uploaded.id}")
    return uploaded.id


def compare_job(client: openai.OpenAI, job_id: str, *, file: str | None, models: list[str],
                criteria: list[dict[str, Any]], samples: int, timeout_s: float, echo: Echo) -> dict[str, Any]:
    """Make the eval from the job, wait for its runs, and return the comparison (its runs in order:
    other models, the start, the checkpoints, the final model), against what the job started from:
    did training help?"""
    with api_errors():
        body = {"file_id": file_id_of(client, file, echo), "models": models, "testing_criteria": criteria,
                "samples_per_item": samples}
        made = client.post(f"/evals/x_from_job/{job_id}", cast_to=dict,
                           body={k: v for k, v in body.items() if v is not None})
        eval_id, runs = made["eval"]["id"], made["runs"]
        echo(f"eval {eval_id}: {len(runs)} runs ({', '.join(r['name'] for r in runs)})")
        wait_for_runs(client, eval_id, [r["id"] for r in runs], timeout_s=timeout_s, echo=echo)
        start = runs[len(models)]["id"]  # the runs of `models` come first
        return comparison(client, eval_id, [r["id"] for r in runs], baseline=start)


def wait_for_runs(client: openai.OpenAI, eval_id: str, run_ids: list[str], *, timeout_s: float, echo: Echo,
                  interval_s: float = 1.0) -> list[Any]:
    """Poll until every run is final (in order: the workers take them in order), printing each as
    it ends; CliError past the timeout or when one did not complete."""
    deadline, ended = time.monotonic() + timeout_s, []
    for run_id in run_ids:
        run = poll_until(lambda run_id=run_id: client.evals.runs.retrieve(run_id, eval_id=eval_id),
                         lambda r: r.status in FINAL, interval=interval_s, deadline=deadline,
                         late=lambda r: f"the runs did not finish within {timeout_s:.0f} s ({r.name}: {r.status})")
        echo(f"  {run.name}: {run.status}, {run.result_counts.passed}/{run.result_counts.total} passed")
        ended.append(run)
    failed = [run for run in ended if run.status != "completed"]
    if failed:
        raise CliError("; ".join(f"run {r.id} ({r.name}) {r.status}: {r.error.message if r.error else ''}"
                                 for r in failed))
    return ended


def comparison(client: openai.OpenAI, eval_id: str, run_ids: list[str], baseline: str | None = None) -> dict[str, Any]:
    params = {"run_ids": ",".join(run_ids), **({"baseline": baseline} if baseline else {})}
    with api_errors():
        return client.get(f"/evals/{eval_id}/x_compare", cast_to=dict, options={"params": params})


def dashboard_url(client: openai.OpenAI, result: dict[str, Any]) -> str:
    """The dashboard page of a comparison: the same runs against the same baseline."""
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    runs = ",".join(r["id"] for r in result["runs"])
    return f"{base}/dashboard/evals/{result['eval_id']}/compare?runs={runs}&baseline={result['baseline_run_id']}"


def report(client: openai.OpenAI, result: dict[str, Any]) -> str:
    """The table, then where to see it on the dashboard."""
    return f"{format_comparison(result)}\ncompare them on the dashboard: {dashboard_url(client, result)}"
