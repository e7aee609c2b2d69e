"""What the user-facing `agent-rft files|jobs|checkpoints|diagnostics` commands do: talk to a
running agent-rft server with the official `openai` SDK, exactly as a user's own code would.
(`agent-rft eval` runs the engine locally: workers/commands/eval_command.py.)

Every function raises CliError with a message meant for the terminal; app/cli.py prints it
and exits 1. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import httpx
import openai
import yaml

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
JOB_CONFIG_KEYS = ("model", "training_file", "validation_file", "method", "seed", "suffix", "metadata")
FILE_KEYS = ("training_file", "validation_file")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")

Echo = Callable[[str], None]
T = TypeVar("T")


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
    """A metrics event in one line: step; train and valid reward and tool calls per rollout (a
    reinforcement step), or train and valid loss and token accuracy (a supervised step)."""
    total = data.get("total_steps")
    parts = [f"step {data.get('step')}" + (f"/{total}" if total is not None else "")]
    for label, key, spec in (("train loss", "train_loss", ".3f"), ("token accuracy", "train_mean_token_accuracy", ".0%"),
                             ("valid loss", "valid_loss", ".3f")):
        if isinstance(data.get(key), (int, float)):
            parts.append(f"{label} {format(data[key], spec)}")
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


# --- checkpoints ----------------------------------------------------------------------------

# What the SDK's `with_streaming_response` sends: the response comes back with its body unread.
STREAMED_BODY = {"X-Stainless-Raw-Response": "stream"}


def download_checkpoint(client: openai.OpenAI, job_id: str, checkpoint_id: str, output: Path | None) -> Path:
    """Stream GET …/checkpoints/{id}/content (a tar) to a temporary file next to the target, extract
    it there (members that would land outside it refused), then move its folder to `output`
    (default ./<job_id>-step-<N>). Returns the folder; nothing is left behind on failure."""
    parent = (output.expanduser().resolve().parent if output else Path.cwd())
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".agent-rft-download-", dir=parent) as tmp:
        archive = Path(tmp) / "checkpoint.tar"
        _stream_to(client, f"/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/content", archive)
        extracted = _extract(archive, Path(tmp) / "extracted")
        target = output.expanduser().resolve() if output else parent / extracted.name
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise CliError(f"{target} already exists and is not empty; pass another --output")
        os.replace(extracted, target)  # an empty directory is replaced
    return target


def _stream_to(client: openai.OpenAI, path: str, destination: Path) -> None:
    with api_errors():
        response = client.get(path, cast_to=httpx.Response, options={"headers": STREAMED_BODY})
    try:
        with destination.open("wb") as out:
            for chunk in response.iter_bytes():
                out.write(chunk)
    except OSError as exc:
        raise CliError(f"cannot write {destination}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the transport's own errors (httpx or httpx2, as the SDK uses)
        raise CliError(f"the download was cut off: {exc}") from exc
    finally:
        response.close()


def _extract(archive: Path, destination: Path) -> Path:
    """Extract with tarfile's "data" filter (no absolute paths, no `..`, no links out, no devices);
    the archive must hold one top folder, which is returned."""
    try:
        with tarfile.open(archive, mode="r:") as tar:
            names = [PurePosixPath(m.name) for m in tar.getmembers()]
            bad = next((n for n in names if n.is_absolute() or ".." in n.parts or not n.parts), None)
            if bad is not None:  # the filter would strip a leading "/"; such an archive is refused whole
                raise CliError(f"refused the checkpoint archive: member {str(bad)!r} points outside its folder")
            tops = {n.parts[0] for n in names}
            if len(tops) != 1:
                raise CliError(f"unexpected archive layout: top-level entries {sorted(tops)}")
            tar.extractall(destination, filter="data")
    except tarfile.TarError as exc:
        raise CliError(f"refused the checkpoint archive: {exc}") from exc
    folder = destination / tops.pop()
    if not folder.is_dir():
        raise CliError(f"unexpected archive layout: {folder.name} is not a folder")
    return folder


def checkpoint_report(client: openai.OpenAI, job_id: str, folder: Path) -> str:
    """Where the checkpoint is and the Python that loads it (the folder's README.md says more)."""
    from app.jobs.checkpoints import ADAPTER_CONFIG, load_snippet

    lora = (folder / ADAPTER_CONFIG).is_file()
    with api_errors():
        model = client.fine_tuning.jobs.retrieve(job_id).model
    snippet = "\n".join(f"    {line}".rstrip() for line in load_snippet(model, str(folder), lora=lora))
    kind = "LoRA adapter" if lora else "full model"
    return (f"saved {kind} to {folder}\nload it with:\n{snippet}\n"
            f"(how it was trained and how to serve it with vLLM: {folder / 'README.md'})")


# --- variance diagnostic (docs/diagnostics.md) -------------------------------------------------

DIAGNOSTICS_PATH = "/fine_tuning/alpha/diagnostics"
DIAGNOSTIC_KEYS = ("model", "training_file", "method", "seed", "metadata")


def create_diagnostic(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/fine_tuning/alpha/diagnostics: `model`, `training_file` (a file id), `method`,
    optional `runs_per_sample`, `max_samples`, `seed`, `metadata`."""
    with api_errors():
        return client.post(DIAGNOSTICS_PATH, body=body, cast_to=object)


def retrieve_diagnostic(client: openai.OpenAI, diagnostic_id: str) -> dict[str, Any]:
    with api_errors():
        return client.get(f"{DIAGNOSTICS_PATH}/{diagnostic_id}", cast_to=object)


def cancel_diagnostic(client: openai.OpenAI, diagnostic_id: str) -> dict[str, Any]:
    with api_errors():
        return client.post(f"{DIAGNOSTICS_PATH}/{diagnostic_id}/cancel", cast_to=object)


def diagnostic_rollouts(client: openai.OpenAI, diagnostic_id: str, *, sample_index: int | None = None,
                        limit: int | None = None) -> list[dict[str, Any]]:
    """The diagnostic's rollouts by sample then run: every page, or the first `limit`."""
    rollouts: list[dict[str, Any]] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": min(100, limit - len(rollouts)) if limit else 100}
        if sample_index is not None:
            params["sample_index"] = sample_index
        if after:
            params["after"] = after
        with api_errors():
            page = client.get(f"{DIAGNOSTICS_PATH}/{diagnostic_id}/rollouts", cast_to=object,
                              options={"params": params})
        rollouts += page["data"]
        if not page["has_more"] or not page["data"] or (limit and len(rollouts) >= limit):
            return rollouts
        after = page["last_id"]


def poll_until(fetch: Callable[[], T], done: Callable[[T], bool], *, interval: float, deadline: float | None,
               late: Callable[[T], str]) -> T:
    """`fetch()` every `interval` seconds until `done` with what it returned; CliError(`late(last)`)
    once the `deadline` (time.monotonic) has passed."""
    while True:
        result = fetch()
        if done(result):
            return result
        if deadline is not None and time.monotonic() > deadline:
            raise CliError(late(result))
        time.sleep(interval)


def wait_for_diagnostic(client: openai.OpenAI, diagnostic_id: str, *, interval: float = 2.0,
                        on_progress: Callable[[dict[str, Any]], None] | None = None,
                        timeout_s: float | None = None) -> dict[str, Any]:
    """Poll until the diagnostic is final; `on_progress` sees every state polled."""
    def fetch() -> dict[str, Any]:
        diagnostic = retrieve_diagnostic(client, diagnostic_id)
        if on_progress:
            on_progress(diagnostic)
        return diagnostic

    return poll_until(fetch, lambda d: d["status"] in FINAL_STATUSES, interval=interval,
                      deadline=time.monotonic() + timeout_s if timeout_s else None,
                      late=lambda d: f"diagnostic {diagnostic_id} did not finish within {timeout_s:.0f} s "
                                     f"(status {d['status']})")


def run_diagnostic(client: openai.OpenAI, *, model: str, training_file: str, method: dict[str, Any],
                   runs_per_sample: int = 3, max_samples: int | None = None, seed: int | None = None,
                   metadata: dict[str, str] | None = None, interval: float = 1.0,
                   on_progress: Callable[[dict[str, Any]], None] | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """Create a diagnostic from a job's inputs (`training_file` is a file id) and wait for it;
    returns the final `fine_tuning.diagnostic` object (status, progress, samples, summary,
    verdict). Raises CliError on an API error or when `timeout_s` runs out."""
    body: dict[str, Any] = {"model": model, "training_file": training_file, "method": method,
                            "runs_per_sample": runs_per_sample}
    body.update({k: v for k, v in (("max_samples", max_samples), ("seed", seed), ("metadata", metadata))
                 if v is not None})
    created = create_diagnostic(client, body)
    return wait_for_diagnostic(client, created["id"], interval=interval, on_progress=on_progress,
                               timeout_s=timeout_s)


def diagnostic_body_from_config(client: openai.OpenAI, config_path: Path, *, runs: int | None,
                                max_samples: int | None, echo: Echo) -> dict[str, Any]:
    """A job YAML (as `jobs create --config` reads it) as a diagnostic request: a local training
    file is uploaded; runs and max_samples come from the options, else from the config's
    x_open_model.diagnostic, else the defaults."""
    config = read_job_config(config_path)
    config = upload_local_files(client, {k: v for k, v in config.items() if k in DIAGNOSTIC_KEYS},
                                config_path.parent, echo)
    preset: Any = config
    for key in ("method", "reinforcement", "x_open_model", "diagnostic"):
        preset = preset.get(key) if isinstance(preset, dict) else None
    preset = preset if isinstance(preset, dict) else {}
    body = dict(config)
    if (value := runs or preset.get("runs_per_sample")) is not None:
        body["runs_per_sample"] = value
    if (value := max_samples or preset.get("max_samples")) is not None:
        body["max_samples"] = value
    return body


def diagnose(client: openai.OpenAI, config_path: Path, *, runs: int | None, max_samples: int | None,
             interval: float, echo: Echo, json_out: Path | None = None) -> dict[str, Any]:
    """`agent-rft diagnose`: create, follow with a progress bar (a line per change when piped),
    then print the summary table, the verdict and the example transcripts."""
    body = diagnostic_body_from_config(client, config_path, runs=runs, max_samples=max_samples, echo=echo)
    created = create_diagnostic(client, body)
    echo(f"{created['id']}  {created['status']}  ({created['runs_per_sample']} runs per sample)")
    if sys.stdout.isatty():
        diagnostic = _wait_with_bar(client, created["id"], interval)
    else:
        last: list[str] = []

        def report(state: dict[str, Any]) -> None:
            line = format_diagnostic_progress(state)
            if not last or line != last[-1]:
                echo(line)
                last.append(line)

        diagnostic = wait_for_diagnostic(client, created["id"], interval=interval, on_progress=report)
    echo(format_diagnostic(diagnostic))
    examples = (diagnostic.get("verdict") or {}).get("example_rollout_ids") or []
    if examples:
        echo("\n" + format_examples(client, diagnostic, examples))
    if json_out:
        json_out.write_text(json.dumps(diagnostic, indent=2))
        echo(f"\nwrote {json_out}")
    return diagnostic


def format_diagnostic_progress(diagnostic: dict[str, Any]) -> str:
    progress = diagnostic["progress"]
    total = progress["samples_total"] if progress["samples_total"] is not None else "?"
    return f"{diagnostic['status']}: {progress['samples_done']}/{total} samples, {progress['rollouts_done']} rollouts"


def _wait_with_bar(client: openai.OpenAI, diagnostic_id: str, interval: float) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.fields[status]}"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
               TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task(diagnostic_id, total=None, status="")

        def update(state: dict[str, Any]) -> None:
            done = state["progress"]
            progress.update(task, completed=done["samples_done"], total=done["samples_total"],
                            status=state["status"])

        return wait_for_diagnostic(client, diagnostic_id, interval=interval, on_progress=update)


def _pct(value: Any) -> str:
    return f"{value * 100:.0f}%" if isinstance(value, (int, float)) else "-"


def _num(value: Any, fmt: str = ".2f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def format_diagnostic(diagnostic: dict[str, Any]) -> str:
    """The summary table, the projected tool load and the verdict, as plain text."""
    lines = [f"{'diagnostic':32} {diagnostic['id']}  {diagnostic['status']}"]
    if diagnostic.get("error"):
        lines.append(f"{'error':32} {diagnostic['error']['code']}: {diagnostic['error']['message']}")
    summary = diagnostic.get("summary")
    if not summary:
        return "\n".join(lines)
    signal = summary["signal"]
    lines += [
        f"{'samples':32} {summary['samples']} ({diagnostic['runs_per_sample']} runs each, {summary['rollouts']} rollouts)",
        f"{'mixed scores (signal)':32} {_pct(signal['mixed']['share'])} ({signal['mixed']['count']})",
        f"{'always 0':32} {_pct(signal['always_0']['share'])} ({signal['always_0']['count']})",
        f"{'always 1':32} {_pct(signal['always_1']['share'])} ({signal['always_1']['count']})",
    ]
    for name, label in (("constant", "same other score every run"), ("ungraded", "not graded")):
        if signal[name]["count"]:
            lines.append(f"{label:32} {_pct(signal[name]['share'])} ({signal[name]['count']})")
    by_tool = ", ".join(f"{name} {value:.2f}" for name, value in summary["tool_calls_per_rollout_by_tool"].items())
    lines += [
        f"{'mean reward':32} {_num(summary['mean_reward'], '.3f')}",
        f"{'tool calls per rollout':32} {_num(summary['mean_tool_calls_per_rollout'])}"
        + (f" ({by_tool})" if by_tool else ""),
        f"{'tool call errors':32} {_pct(summary['tool_error_rate'])} of calls; "
        f"{_pct(summary['tool_failure_rate'])} of rollouts ended in a tool failure",
        f"{'grader errors':32} {_pct(summary['grader_error_rate'])} of rollouts",
        f"{'tokens per rollout':32} prompt {_num(summary['prompt_tokens_per_rollout'], '.1f')}, completion "
        f"{_num(summary['completion_tokens_per_rollout'], '.1f')}, tool output "
        f"{_num(summary['tool_output_tokens_per_rollout'], '.1f')}",
        f"{'latency per rollout':32} {_num(summary['latency_s_mean'])} s mean, {_num(summary['latency_s_max'])} s max",
        f"{'finish reasons':32} " + ", ".join(f"{k} {_pct(v)}" for k, v in summary["finish_reasons"].items()),
    ]
    lines += _format_load(summary.get("load_projection") or [])
    verdict = diagnostic.get("verdict") or {}
    lines.append(f"\nverdict ({verdict.get('level', '-')}): {verdict.get('message', '-')}")
    lines += [f"  note: {note}" for note in verdict.get("notes") or []]
    if verdict.get("example_rollout_ids"):
        lines.append(f"example rollouts: {', '.join(verdict['example_rollout_ids'])}")
    return "\n".join(lines)


def _format_load(projection: list[dict[str, Any]]) -> list[str]:
    rows = [(f"{p['compute_multiplier']:g}" + ("*" if p.get("configured") else ""), str(p["batch_size"]),
             str(p["group_size"]), str(p["rollouts_per_step"]), name, f"{tool['calls_per_step']:.1f}",
             f"{tool.get('calls_saved_per_step') or 0:.1f}", str(tool["peak_concurrency"]))
            for p in projection for name, tool in p["tools"].items()]
    if not rows:
        return ["\nprojected tool load per training step: no tool calls in these rollouts"] if projection else []
    rows.insert(0, ("compute_multiplier", "batch", "group", "rollouts", "tool", "calls/step", "from cache",
                    "peak concurrency"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    notes = []
    if any(p.get("sampling_overlaps_update") for p in projection):
        notes.append("  sampled ahead (max_staleness 1): the calls come without a pause for the update, and peak "
                     "concurrency counts an eval's rollouts beside the step's")
    if any(p.get("prompts_per_step_max", p["batch_size"]) > p["batch_size"] for p in projection):
        notes.append("  refill_zero_spread: a step may draw more prompts, up to calls_per_step_max calls")
    return ["\nprojected tool load per training step (* = this config):", *table, *notes]


def format_examples(client: openai.OpenAI, diagnostic: dict[str, Any], rollout_ids: list[str],
                    width: int = 300) -> str:
    """The transcripts of the verdict's example rollouts."""
    sample_of = {rid: s["sample_index"] for s in diagnostic.get("samples") or [] for rid in s["rollout_ids"]}
    blocks = []
    for rollout_id in rollout_ids:
        if rollout_id not in sample_of:
            continue
        found = [r for r in diagnostic_rollouts(client, diagnostic["id"], sample_index=sample_of[rollout_id])
                 if r["id"] == rollout_id]
        if found:
            blocks.append(format_transcript(found[0], width))
    return "\n\n".join(blocks)


def format_transcript(rollout: dict[str, Any], width: int = 300) -> str:
    data = rollout.get("data") or {}
    head = (f"--- {rollout['id']} (sample {rollout['sample_index']}, run {rollout['run_index']}): reward "
            f"{_num(rollout.get('reward'), '.3f')}, {rollout.get('finish_reason')}, {rollout['tool_calls']} tool calls")
    lines = [head]
    for message in data.get("messages") or []:
        content = str(message.get("content", ""))
        if len(content) > width:
            content = content[:width] + f" … [{len(content) - width} more characters]"
        lines.append(f"[{message.get('role')}] {content}")
    return "\n".join(lines)
