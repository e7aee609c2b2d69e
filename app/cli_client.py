"""What the user-facing `agent-rft files|jobs|eval` commands do: talk to a running agent-rft
server with the official `openai` SDK (exactly as a user's own code would), and run the
before/after evaluation locally with the training engine.

Every function raises CliError with a message meant for the terminal; app/cli.py prints it
and exits 1. Heavy libraries (torch, the model registry) are imported only by `evaluate`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import yaml

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
JOB_CONFIG_KEYS = ("model", "training_file", "validation_file", "method", "seed", "suffix", "metadata")
FILE_KEYS = ("training_file", "validation_file")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")
PASS_THRESHOLD = 0.5  # a reward at or above this counts as passed when the grader has no threshold

Echo = Callable[[str], None]


class CliError(Exception):
    """A failure to show the user as `error: <message>`, exit status 1."""


# --- the client -----------------------------------------------------------------------------


def make_client(base_url: str, api_key: str | None) -> openai.OpenAI:
    if not api_key:
        raise CliError("no API key: pass --api-key or set AGENT_RFT_API_KEY (or OPENAI_API_KEY); "
                       "create one with `agent-rft projects create NAME`")
    return openai.OpenAI(base_url=base_url, api_key=api_key)


@contextlib.contextmanager
def api_errors() -> Iterator[None]:
    """Turn the SDK's exceptions into `<code>: <message> (param: …)`, as the API reported them."""
    try:
        yield
    except openai.APIConnectionError as exc:
        raise CliError(f"cannot reach the server at {exc.request.url}: {exc.message}") from exc
    except openai.APIStatusError as exc:
        raise CliError(describe_api_error(exc)) from exc


def describe_api_error(exc: openai.APIStatusError) -> str:
    message = exc.body.get("message") if isinstance(exc.body, dict) else None
    text = f"{exc.code or exc.status_code}: {message or exc.message}"
    return f"{text} (param: {exc.param})" if exc.param else text


# --- files ----------------------------------------------------------------------------------


def upload_file(client: openai.OpenAI, path: Path, purpose: str) -> Any:
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    with api_errors(), path.open("rb") as fh:
        return client.files.create(file=(path.name, fh), purpose=purpose)


def format_file(uploaded: Any) -> str:
    return f"{uploaded.id}  {uploaded.bytes} bytes  {uploaded.filename}"


# --- jobs -----------------------------------------------------------------------------------


def read_job_config(path: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CliError(f"{path}: cannot read the job configuration: {exc}") from exc
    if not isinstance(config, dict):
        raise CliError(f"{path}: expected a mapping with keys {', '.join(JOB_CONFIG_KEYS)}")
    unknown = sorted(set(config) - set(JOB_CONFIG_KEYS))
    if unknown:
        raise CliError(f"{path}: unknown keys {', '.join(unknown)}; allowed: {', '.join(JOB_CONFIG_KEYS)}")
    for key in ("model", "training_file"):
        if not config.get(key):
            raise CliError(f"{path}: '{key}' is required")
    return config


def upload_local_files(client: openai.OpenAI, config: dict[str, Any], base_dir: Path, echo: Echo) -> dict[str, Any]:
    """Replace a training/validation file given as a local path (relative to the YAML's folder)
    by the id of its upload; a value that is no existing file is sent as a file id."""
    resolved = dict(config)
    for key in FILE_KEYS:
        value = config.get(key)
        if not isinstance(value, str):
            continue
        local = (base_dir / value).expanduser()
        if local.is_file():
            uploaded = upload_file(client, local, "fine-tune")
            echo(f"uploaded {local} as {format_file(uploaded)}")
            resolved[key] = uploaded.id
    return resolved


def create_job(client: openai.OpenAI, config_path: Path, echo: Echo) -> Any:
    config = upload_local_files(client, read_job_config(config_path), config_path.parent, echo)
    with api_errors():
        return client.fine_tuning.jobs.create(**config)


def list_jobs(client: openai.OpenAI, *, limit: int, metadata: list[str]) -> list[Any]:
    filters = parse_metadata(metadata)
    with api_errors():
        page = client.fine_tuning.jobs.list(limit=limit, **({"metadata": filters} if filters else {}))
    return list(page.data)


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    filters = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--metadata expects key=value, got {pair!r}")
        filters[key] = value
    return filters


def format_jobs_table(jobs: list[Any]) -> str:
    rows = [("ID", "STATUS", "MODEL", "CREATED", "FINE_TUNED_MODEL")]
    rows += [(j.id, j.status, j.model, format_time(j.created_at), j.fine_tuned_model or "-") for j in jobs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def format_time(timestamp: int | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def job_events(client: openai.OpenAI, job_id: str, *, limit: int | None) -> list[Any]:
    """The job's events, oldest first (the API pages them newest first): the newest `limit`, or all."""
    with api_errors():
        if limit is not None:
            events = list(client.fine_tuning.jobs.list_events(job_id, limit=limit).data)
        else:
            events = list(client.fine_tuning.jobs.list_events(job_id, limit=100))  # follows every page
    return events[::-1]


def format_event(event: Any) -> str:
    message = summarize_metrics(event.data or {}) if event.type == "metrics" else event.message
    return f"{format_time(event.created_at)}  {event.level:5}  {message}"


def summarize_metrics(data: dict[str, Any]) -> str:
    """A metrics event in one line: step, train and valid reward, tool calls per rollout."""
    total = data.get("total_steps")
    parts = [f"step {data.get('step')}" + (f"/{total}" if total is not None else "")]
    scores = data.get("scores") or {}
    for label, key in (("train reward", "train_reward_mean"), ("valid reward", "valid_reward_mean")):
        if isinstance(scores.get(key), (int, float)):
            parts.append(f"{label} {scores[key]:.3f}")
    calls = (data.get("tools") or {}).get("tool_calls_per_rollout")
    if isinstance(calls, (int, float)):
        parts.append(f"tool calls/rollout {calls:.2f}")
    return ", ".join(parts)


# --- watch ----------------------------------------------------------------------------------


def metrics_events(client: openai.OpenAI, job_id: str) -> list[Any]:
    """The newest page of metrics events, oldest first."""
    with api_errors():
        page = client.fine_tuning.jobs.list_events(job_id, limit=100)
    return [e for e in reversed(page.data) if e.type == "metrics" and e.data]


def eta_seconds(events: list[Any]) -> float | None:
    """Remaining time: the mean time per step between metrics events (or the last step's own
    timing when there is one event) times the steps left."""
    if not events:
        return None
    last = events[-1].data
    total, step = last.get("total_steps"), last.get("step")
    if not isinstance(total, int) or not isinstance(step, int):
        return None
    first = events[0]
    if len(events) > 1 and step > first.data.get("step", step):
        per_step = (events[-1].created_at - first.created_at) / (step - first.data["step"])
    else:
        per_step = ((last.get("timing") or {}).get("step") or {}).get("full_iteration")
    return max(total - step, 0) * per_step if isinstance(per_step, (int, float)) else None


def progress_fields(events: list[Any]) -> dict[str, Any]:
    last = events[-1].data if events else {}
    scores = last.get("scores") or {}
    valid = next((e.data["scores"]["valid_reward_mean"] for e in reversed(events)
                  if isinstance((e.data.get("scores") or {}).get("valid_reward_mean"), (int, float))), None)
    return {"step": last.get("step", 0) or 0, "total": last.get("total_steps"),
            "train": scores.get("train_reward_mean"), "valid": valid,
            "calls": (last.get("tools") or {}).get("tool_calls_per_rollout"), "eta": eta_seconds(events)}


def format_progress(status: str, fields: dict[str, Any]) -> str:
    def number(value: Any, fmt: str = ".3f") -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    total = fields["total"] if fields["total"] is not None else "?"
    eta = fields["eta"]
    return (f"{status}: step {fields['step']}/{total}, train reward {number(fields['train'])}, "
            f"valid reward {number(fields['valid'])}, tool calls/rollout {number(fields['calls'], '.2f')}, "
            f"ETA {f'{eta:.0f} s' if eta is not None else '-'}")


def watch_job(client: openai.OpenAI, job_id: str, *, interval: float, echo: Echo) -> Any:
    """Follow a job until it is final; a live bar on a terminal, a line per change otherwise."""
    if sys.stdout.isatty():
        return _watch_with_bar(client, job_id, interval)
    last_line = None
    while True:
        job = _retrieve(client, job_id)
        line = format_progress(job.status, progress_fields(metrics_events(client, job_id)))
        if line != last_line:
            echo(line)
            last_line = line
        if job.status in FINAL_STATUSES:
            return job
        time.sleep(interval)


def _watch_with_bar(client: openai.OpenAI, job_id: str, interval: float) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (TextColumn("{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns) as progress:
        task = progress.add_task(job_id, total=None, status="", detail="")
        while True:
            job = _retrieve(client, job_id)
            fields = progress_fields(metrics_events(client, job_id))
            detail = format_progress("", fields).split(", ", 1)[-1]
            progress.update(task, completed=fields["step"], total=fields["total"], status=job.status, detail=detail)
            if job.status in FINAL_STATUSES:
                return job
            time.sleep(interval)


def _retrieve(client: openai.OpenAI, job_id: str) -> Any:
    with api_errors():
        return client.fine_tuning.jobs.retrieve(job_id)


def final_report(job: Any) -> str:
    if job.status == "succeeded":
        return f"succeeded: fine_tuned_model {job.fine_tuned_model}"
    if job.error and job.error.message:
        return f"{job.status}: {job.error.code}: {job.error.message}"
    return job.status


# --- eval -----------------------------------------------------------------------------------


def read_grader(path: Path) -> Any:
    from pydantic import TypeAdapter, ValidationError

    from app.graders.schemas import Grader

    try:
        return TypeAdapter(Grader).validate_json(path.read_bytes())
    except OSError as exc:
        raise CliError(f"{path}: cannot read the grader: {exc}") from exc
    except ValidationError as exc:
        raise CliError(f"{path}: invalid grader: {exc}") from exc


def evaluate(*, model: str, data: Path, tools_path: Path, grader_path: Path, n: int, limit: int | None,
             config: Any, settings: Any, json_out: Path | None, echo: Echo) -> dict[str, Any]:
    """Rollouts of `model` with the training engine, each graded: accuracy and tool use."""
    import asyncio

    from workers.rl.models import ModelError
    from workers.rl.rollout_command import (
        RolloutInputError,
        read_specs,
        read_tools,
        run_rollouts,
    )

    grader = read_grader(grader_path)
    try:
        tools = read_tools(tools_path)
        specs = read_specs(data, tools, n=n, limit=limit, seed=0)
        if not specs:
            raise CliError(f"{data}: no rows")
        records = asyncio.run(run_rollouts(model, specs, tools, config, list(settings.outbound_allowlist)))
    except (RolloutInputError, ModelError, OSError) as exc:
        raise CliError(str(exc)) from exc
    graded = asyncio.run(_grade(grader, records, specs, settings))
    report = eval_report(model, records, graded)
    echo(format_eval(report))
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
        echo(f"\nwrote {json_out}")
    return report


async def _grade(grader: Any, records: list[Any], specs: list[Any], settings: Any) -> list[Any]:
    from app.graders.batch import grade_many
    from app.graders.core import Sample
    from app.graders.service import grader_context

    jobs = [(Sample.from_model_sample(r.grader_sample()), s.item, r.trace_id) for r, s in zip(records, specs)]
    return await grade_many(grader, jobs, grader_context(settings))


def eval_report(model: str, records: list[Any], graded: list[Any]) -> dict[str, Any]:
    from workers.rl.summary import summarize

    rewards = [g.reward for g in graded]
    passed = [g.passed if g.passed is not None else g.reward >= PASS_THRESHOLD for g in graded]
    accuracy = {"mean_reward": sum(rewards) / len(rewards), "pass_rate": sum(passed) / len(passed),
                "grader_errors": sum(1 for g in graded if g.failed)}
    rollouts = [{**r.summary(), "reward": g.reward, "passed": p, "grader_errors": g.errors}
                for r, g, p in zip(records, graded, passed)]
    return {"model": model, "accuracy": accuracy, "summary": summarize(records), "rollouts": rollouts}


def format_eval(report: dict[str, Any]) -> str:
    from workers.rl.summary import format_table

    accuracy = report["accuracy"]
    lines = [f"{'model':36} {report['model']}",
             f"{'mean reward':36} {accuracy['mean_reward']:.3f}",
             f"{'passed (reward >= 0.5 or passed)':36} {accuracy['pass_rate']:.0%}",
             f"{'grader errors':36} {accuracy['grader_errors']}"]
    return "\n".join(lines) + "\n" + format_table(report["summary"])
