"""`agent-rft`: run migrations, manage projects and keys, serve the API, start workers."""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from app.core.config import get_settings

cli = typer.Typer(help="agent-rft: reinforcement fine-tuning of open-weight agents.", no_args_is_help=True,
                  add_completion=False)
db_cli = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)
projects_cli = typer.Typer(help="Projects: every object belongs to one.", no_args_is_help=True)
keys_cli = typer.Typer(help="API keys of a project.", no_args_is_help=True)
secrets_cli = typer.Typer(help="The keys that encrypt stored secrets (docs/security.md).", no_args_is_help=True)
cli.add_typer(db_cli, name="db")
cli.add_typer(projects_cli, name="projects")
cli.add_typer(keys_cli, name="keys")
cli.add_typer(secrets_cli, name="secrets")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


# What the commands that load a model import. `pip install agent-rft` (the control plane) has none
# of them; the worker and inference extras do (agent_rft/extras.py).
MODEL_PACKAGES = ("torch", "transformers", "peft")
WORKER_PACKAGES = (*MODEL_PACKAGES, "sentence_transformers")
TOKENIZER_PACKAGES = ("transformers", "tokenizers")  # the front of a vLLM fleet: tokenizers only, no torch


def _require_extra(extra: str, command: str, modules: tuple[str, ...]) -> None:
    """Fail with the extra to install, before a slim installation dies in an ImportError mid-run."""
    from agent_rft.extras import missing_extra

    if message := missing_extra(extra, f"`agent-rft {command}`", *modules):
        _fail(message)


@db_cli.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Migrate the database to the latest schema (or to REVISION)."""
    from app.core.migrations import upgrade

    settings = get_settings()
    upgrade(settings.resolved_database_url, revision)
    typer.echo(f"database is at revision {revision}")


@db_cli.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target revision; 'base' empties the database.")]) -> None:
    """Migrate the database back to REVISION."""
    from app.core.migrations import downgrade

    downgrade(get_settings().resolved_database_url, revision)
    typer.echo(f"database is at revision {revision}")


@db_cli.command("current")
def db_current() -> None:
    """Print the database's schema revision and the one this version needs."""
    from app.core.db import make_engine
    from app.core.migrations import current_revision, head_revision

    engine = make_engine(get_settings().resolved_database_url)
    typer.echo(f"current: {current_revision(engine) or '(empty)'}\nhead:    {head_revision()}")


def _session_factory():  # noqa: ANN202
    from app.core.db import make_engine, make_session_factory
    from app.core.migrations import SchemaNotReady, ensure_schema

    engine = make_engine(get_settings().resolved_database_url)
    try:
        ensure_schema(engine, auto_migrate=get_settings().auto_migrate)
    except SchemaNotReady as exc:
        _fail(str(exc))
    return make_session_factory(engine)


def _session():  # noqa: ANN202
    return _session_factory().begin()


def _print_key(created, what: str) -> None:  # noqa: ANN001
    typer.echo(f"{what} (project {created.project_name}, {created.project_id}).")
    typer.echo("API key (shown once, store it now; only its hash is kept):")
    typer.echo(created.secret)


@projects_cli.command("create")
def projects_create(name: str) -> None:
    """Create project NAME and print its first API key (once)."""
    from app.auth.service import ProjectError, create_project

    with _session() as session:
        try:
            created = create_project(session=session, name=name)
        except ProjectError as exc:
            _fail(str(exc))
    _print_key(created, "Created project")


@projects_cli.command("set-wandb-key")
def projects_set_wandb_key(
    project: Annotated[str, typer.Argument(help="Project name.")],
    key_stdin: Annotated[bool, typer.Option("--key-stdin", help="Read the key from standard input (for scripts); "
                                                                "default: a hidden prompt.")] = False,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the project's key.")] = False,
) -> None:
    """Set the project's Weights & Biases API key, used by its jobs' `wandb` integration. It is stored
    encrypted and never shown; it is read from stdin or a prompt, never an argument (shell history)."""
    from app.auth.service import ProjectError, set_integration_key

    key = None if clear else (sys.stdin.read() if key_stdin else typer.prompt("W&B API key", hide_input=True))
    box = _secret_box()
    with _session() as session:
        try:
            set_integration_key(session=session, project_name=project, integration="wandb", key=key, box=box)
        except ProjectError as exc:
            _fail(str(exc))
    typer.echo(f"Removed the W&B API key of project {project}." if clear
               else f"Stored the W&B API key of project {project} (encrypted; it is never shown).")


@keys_cli.command("create")
def keys_create(
    project: Annotated[str, typer.Option("--project", help="Project name.")],
    expires_in_days: Annotated[float | None, typer.Option(
        min=0.001, help="The key answers 401 after this many days (default: never expires).")] = None,
) -> None:
    """Create another API key for a project and print it (once)."""
    from datetime import timedelta

    from app.auth.service import ProjectError, create_key
    from app.core.db import utcnow

    expires_at = utcnow() + timedelta(days=expires_in_days) if expires_in_days else None
    with _session() as session:
        try:
            created = create_key(session=session, project_name=project, expires_at=expires_at)
        except ProjectError as exc:
            _fail(str(exc))
    _print_key(created, "Created API key")
    if expires_at:
        typer.echo(f"It expires at {expires_at:%Y-%m-%d %H:%M} UTC.")


def _when(moment: Any) -> str:
    return f"{moment:%Y-%m-%d %H:%M}" if moment else "-"


@keys_cli.command("list")
def keys_list(project: Annotated[str, typer.Option("--project", help="Project name.")]) -> None:
    """A project's keys: id, prefix, created, last used, expiry and state; never the secret."""
    from app.auth.service import ProjectError, list_keys
    from app.core.db import utcnow

    with _session() as session:
        try:
            keys = list_keys(session=session, project_name=project)
        except ProjectError as exc:
            _fail(str(exc))
    now = utcnow()
    typer.echo(f"{'id':30} {'prefix':10} {'created (UTC)':17} {'last used':17} {'expires':17} state")
    for key in keys:
        typer.echo(f"{key.key_id:30} {key.display_prefix + '…':10} {_when(key.created_at):17} "
                   f"{_when(key.last_used_at):17} {_when(key.expires_at):17} {key.state(now)}")


@keys_cli.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="The key's id, as `keys list` shows it.")]) -> None:
    """Revoke an API key: it answers 401 from the next request on."""
    from app.auth.service import ProjectError, revoke_key

    with _session() as session:
        try:
            key = revoke_key(session=session, key_id=key_id)
        except ProjectError as exc:
            _fail(str(exc))
    typer.echo(f"Revoked {key.key_id} ({key.display_prefix}…) at {_when(key.revoked_at)} UTC.")


def _secret_box():  # noqa: ANN202
    from app.core.crypto import SecretKeysMissing, secret_box

    try:
        return secret_box(get_settings())
    except SecretKeysMissing as exc:
        _fail(str(exc))


@secrets_cli.command("generate-key")
def secrets_generate_key() -> None:
    """Print a new key for AGENT_RFT_SECRET_KEYS (to rotate: put it first, then run `reencrypt`)."""
    from app.core.crypto import generate_key

    typer.echo(generate_key())


def _rewrite_all(rewrite, verb: str) -> None:  # noqa: ANN001
    from app.core.crypto import SecretUnreadable

    box = _secret_box()
    try:
        done = rewrite(_session_factory(), box)
    except SecretUnreadable as exc:
        _fail(str(exc))
    typer.echo(f"{verb} {done.headers} header values (of tools and graders) and {done.webhook_secrets} "
               "webhook signing secrets.")
    typer.echo(f"{verb} {done.integration_keys} project integration keys (W&B API keys).")


@secrets_cli.command("reencrypt")
def secrets_reencrypt() -> None:
    """Encrypt every stored secret under the newest key (and any stored before encryption); idempotent."""
    from app.secrets_at_rest import reencrypt

    _rewrite_all(reencrypt, "Re-encrypted")


@secrets_cli.command("decrypt")
def secrets_decrypt() -> None:
    """Store every secret in plain text again: only for `agent-rft db downgrade` below revision 0007."""
    from app.secrets_at_rest import decrypt

    _rewrite_all(decrypt, "Decrypted")


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default AGENT_RFT_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default AGENT_RFT_PORT).")] = None,
) -> None:
    """Run the control plane (REST API, OpenAPI docs at /docs)."""
    import uvicorn

    from app.core.crypto import SecretKeysMissing
    from app.core.db import make_engine
    from app.core.migrations import SchemaNotReady, ensure_schema
    from app.main import create_app

    settings = get_settings()
    try:
        ensure_schema(make_engine(settings.resolved_database_url), auto_migrate=settings.auto_migrate)
        app = create_app(settings)
    except (SchemaNotReady, SecretKeysMissing) as exc:
        _fail(str(exc))
    uvicorn.run(app, host=host or settings.host, port=port or settings.port)


@cli.command()
def worker(
    queues: Annotated[str | None, typer.Option(
        help="Comma-separated queues (default AGENT_RFT_TRAINING_QUEUE and AGENT_RFT_WEBHOOK_QUEUE).")] = None,
    concurrency: Annotated[int, typer.Option(help="Tasks run at once.")] = 1,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "info",
) -> None:
    """Start a Celery worker for training jobs and webhook deliveries."""
    from workers.celery_app import celery_app

    settings = get_settings()
    queue_names = queues or f"{settings.training_queue},{settings.webhook_queue}"
    # A worker of the webhook queue alone delivers HTTP requests: the slim install is enough for it.
    if settings.training_queue in [name.strip() for name in queue_names.split(",")]:
        _require_extra("worker", "worker", WORKER_PACKAGES)
    celery_app.worker_main(["worker", "-Q", queue_names, "-c", str(concurrency), "-l", loglevel, "-P", "solo"
                            if concurrency == 1 else "prefork"])


@cli.command()
def inference(
    host: Annotated[str | None, typer.Option(help="Bind address (default AGENT_RFT_INFERENCE_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default AGENT_RFT_INFERENCE_PORT).")] = None,
) -> None:
    """Run the inference server: chat completions for base models, fine-tuned models and checkpoints
    (the API forwards /v1/chat/completions to it; docs/serving.md)."""
    settings = get_settings()
    _require_extra("inference", "inference",
                   TOKENIZER_PACKAGES if settings.inference_backend == "vllm" else MODEL_PACKAGES)
    import uvicorn

    from workers.inference.server import create_inference_app

    uvicorn.run(create_inference_app(settings), host=host or settings.inference_host,
                port=port or settings.inference_port)


class Precision(str, enum.Enum):
    """x_open_model.dtype, for the commands that load a model here."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


DType = Annotated[Precision, typer.Option(
    "--dtype", help="Weights' precision: auto (bfloat16 on a GPU, float32 on a CPU), float32, or bfloat16 "
                    "(about 1.5x faster on CPUs with native bf16, as x_open_model.dtype).")]


@cli.command()
def rollout(
    model: Annotated[str, typer.Option(help="Model name (SmolLM2-135M-Instruct, tiny-smollm2), directory or HF id.")],
    data: Annotated[Path, typer.Option(help="JSONL rows: messages, optional tools schemas, item fields.")],
    tools: Annotated[Path, typer.Option(help="JSON list of {name, server_url, headers?, parameters?}.")],
    n: Annotated[int, typer.Option(min=1, help="Rollouts per row.")] = 4,
    max_episode_steps: Annotated[int, typer.Option(min=1, help="Tool-call budget per rollout.")] = 10,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first LIMIT rows.")] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    max_tokens_per_turn: Annotated[int, typer.Option(min=1)] = 256,
    max_tokens_per_rollout: Annotated[int, typer.Option(min=1)] = 2048,
    seed: Annotated[int, typer.Option(help="Base seed of the rollouts.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write records and summary here.")] = None,
    dtype: DType = Precision.auto,
) -> None:
    """Run rollouts of MODEL against real tools and print transcripts and a summary table."""
    _require_extra("worker", "rollout", MODEL_PACKAGES)
    from workers.models.registry import ModelError
    from workers.engine.rollout import EngineConfig
    from workers.commands.rollout_command import RolloutInputError, rollout_command

    config = EngineConfig(max_episode_steps=max_episode_steps, max_tokens_per_turn=max_tokens_per_turn,
                          max_tokens_per_rollout=max_tokens_per_rollout, temperature=temperature, top_p=top_p)
    try:
        rollout_command(model=model, data=data, tools_path=tools, n=n, limit=limit, config=config,
                        allowlist=get_settings().outbound_allowlist, seed=seed, json_out=json_out, echo=typer.echo,
                        dtype=dtype.value)
    except (RolloutInputError, ModelError, OSError) as exc:
        _fail(str(exc))


# --- client commands: a running server, through the official `openai` SDK (app/cli_client.py) ---

files_cli = typer.Typer(help="Files on an agent-rft server (through the openai SDK).", no_args_is_help=True)
jobs_cli = typer.Typer(help="Fine-tuning jobs on an agent-rft server (through the openai SDK).", no_args_is_help=True)
cli.add_typer(files_cli, name="files")
cli.add_typer(jobs_cli, name="jobs")

BaseUrl = Annotated[str, typer.Option("--base-url", envvar="AGENT_RFT_BASE_URL", help="The server's /v1 URL.")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar=["AGENT_RFT_API_KEY", "OPENAI_API_KEY"],
                                            show_default=False, help="A project's API key.")]
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


def _client_call(action: Callable[[], Any]) -> Any:
    """Run a client action; its CliError becomes `error: …` and exit status 1."""
    from app.cli_client import CliError

    try:
        return action()
    except CliError as exc:
        _fail(str(exc))


def _client(base_url: str, api_key: str | None) -> Any:
    from app.cli_client import make_client

    return _client_call(lambda: make_client(base_url, api_key))


@files_cli.command("upload")
def files_upload(path: Path, purpose: Annotated[str, typer.Option()] = "fine-tune",
                 base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Upload PATH; print its file id and size."""
    from app.cli_client import format_file, upload_file

    uploaded = _client_call(lambda: upload_file(_client(base_url, api_key), path, purpose))
    typer.echo(format_file(uploaded))


@jobs_cli.command("create")
def jobs_create(config: Annotated[Path, typer.Option("--config", help="Job YAML (see docs/cli.md).")],
                base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Create a job from a YAML file; local training/validation files are uploaded first."""
    from app.cli_client import create_job

    job = _client_call(lambda: create_job(_client(base_url, api_key), config, typer.echo))
    typer.echo(f"{job.id}  {job.status}")


@jobs_cli.command("list")
def jobs_list(limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
              metadata: Annotated[list[str] | None, typer.Option(help="key=value filter; repeatable.")] = None,
              base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """List jobs, newest first, as a table."""
    from app.cli_client import format_jobs_table, list_jobs

    jobs = _client_call(lambda: list_jobs(_client(base_url, api_key), limit=limit, metadata=metadata or []))
    typer.echo(format_jobs_table(jobs))


@jobs_cli.command("events")
def jobs_events(job_id: str, limit: Annotated[int | None, typer.Option(min=1, max=100, help="Only the newest N.")] = None,
                base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Print a job's events, oldest first: time, level, message (metrics summarised)."""
    from app.cli_client import format_event, job_events

    for event in _client_call(lambda: job_events(_client(base_url, api_key), job_id, limit=limit)):
        typer.echo(format_event(event))


@jobs_cli.command("watch")
def jobs_watch(job_id: str, interval: Annotated[float, typer.Option(min=0.1, help="Seconds between polls.")] = 2.0,
               base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Follow a job's progress until it finishes; exit 0 if it succeeded, 1 otherwise."""
    from app.cli_client import final_report, watch_job

    job = _client_call(lambda: watch_job(_client(base_url, api_key), job_id, interval=interval, echo=typer.echo))
    typer.echo(final_report(job))
    raise typer.Exit(code=0 if job.status == "succeeded" else 1)


checkpoints_cli = typer.Typer(help="Checkpoints of fine-tuning jobs (docs/checkpoints.md).", no_args_is_help=True)
cli.add_typer(checkpoints_cli, name="checkpoints")


@checkpoints_cli.command("download")
def checkpoints_download(job_id: str, checkpoint_id: str,
                         output: Annotated[Path | None, typer.Option(
                             "--output", help="Folder to create (default ./<job_id>-step-<N>).")] = None,
                         base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Download a checkpoint (LoRA adapter or full model) into a folder; print how to load it."""
    from app.cli_client import checkpoint_report, download_checkpoint

    client = _client(base_url, api_key)
    folder = _client_call(lambda: download_checkpoint(client, job_id, checkpoint_id, output))
    typer.echo(_client_call(lambda: checkpoint_report(client, job_id, folder)))


@cli.command("chat")
def chat_command(
    model: Annotated[str, typer.Argument(help="A base model, fine-tuned model (ft:...) or checkpoint (ft:...:ckpt-step-N).")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="Ask this once and exit (default: a conversation).")] = None,
    tools: Annotated[Path | None, typer.Option("--tools", help="JSON list of tool schemas; the model's tool calls are shown.")] = None,
    system: Annotated[str | None, typer.Option("--system", help="A system message.")] = None,
    tool_choice: Annotated[str | None, typer.Option(
        "--tool-choice", help="auto, none, required, or a tool's name: the model's first answer to each message "
                              "then calls it (OpenAI's tool_choice).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(min=0, max=2)] = 0.0,
    base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None,
) -> None:
    """Chat with MODEL through /v1/chat/completions (streamed). With --tools, tool calls are shown and,
    in a conversation, you type each tool's result, as your agent loop would send it (docs/serving.md)."""
    from app.serving.cli import chat, read_tools

    schemas = _client_call(lambda: read_tools(tools)) if tools else []
    _client_call(lambda: chat(_client(base_url, api_key), model, tools=schemas, system=system, message=message,
                              max_tokens=max_tokens, temperature=temperature, echo=typer.echo, ask=input,
                              tool_choice=tool_choice))


diagnostics_cli = typer.Typer(help="Variance diagnostics on an agent-rft server (docs/diagnostics.md).",
                              no_args_is_help=True)
cli.add_typer(diagnostics_cli, name="diagnostics")


@cli.command()
def diagnose(config: Annotated[Path, typer.Option("--config", help="Job YAML, as for `jobs create` (docs/cli.md).")],
             runs: Annotated[int | None, typer.Option("--runs", min=2, help="Runs per sample (default 3).")] = None,
             max_samples: Annotated[int | None, typer.Option("--max-samples", min=1,
                                                             help="Diagnose at most N rows.")] = None,
             interval: Annotated[float, typer.Option(min=0.1, help="Seconds between polls.")] = 2.0,
             json_out: Annotated[Path | None, typer.Option("--json", help="Also write the diagnostic here.")] = None,
             base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Run every sample several times before training and show where learning can happen;
    exit 0 if the diagnostic succeeded."""
    from app.cli_client import diagnose as run

    diagnostic = _client_call(lambda: run(_client(base_url, api_key), config, runs=runs, max_samples=max_samples,
                                          interval=interval, echo=typer.echo, json_out=json_out))
    raise typer.Exit(code=0 if diagnostic["status"] == "succeeded" else 1)


evals_cli = typer.Typer(help="Evals and their runs on an agent-rft server (docs/evals.md).", no_args_is_help=True)
cli.add_typer(evals_cli, name="evals")
CsvOut = Annotated[Path | None, typer.Option("--csv", help="Also write the comparison as CSV here.")]
PerItem = Annotated[bool, typer.Option("--per-item", help="The CSV has a row per item (deltas, quadrant).")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Also write the comparison as JSON here.")]


def _write_comparison(result: dict[str, Any], csv_out: Path | None, per_item: bool, json_out: Path | None) -> None:
    from app.evals.compare import comparison_csv

    if csv_out is not None:
        csv_out.write_text(comparison_csv(result, per_item=per_item))
        typer.echo(f"wrote {csv_out}")
    if json_out is not None:
        import json

        json_out.write_text(json.dumps(result, indent=2))
        typer.echo(f"wrote {json_out}")


@cli.command()
def compare(job_id: Annotated[str, typer.Argument(help="A succeeded fine-tuning job.")],
            file: Annotated[str | None, typer.Option("--file", help="Items: a file id or a local JSONL file (rows as "
                                                                    "the job's); default its validation file.")] = None,
            model: Annotated[list[str] | None, typer.Option("--model", help="Also run this model first (e.g. the base "
                                                                            "under an ft: start); repeatable.")] = None,
            criterion: Annotated[list[Path] | None, typer.Option(
                "--criterion", help="A grader JSON file to grade by besides the job's grader; repeatable.")] = None,
            samples: Annotated[int, typer.Option(min=1, max=16, help="Samples per item.")] = 1,
            timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for the runs.")] = 3600,
            csv_out: CsvOut = None, per_item: PerItem = False, json_out: JsonOut = None,
            base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Which checkpoint to ship: run what JOB started from, its kept checkpoints and its final model
    over its validation file with its tools and grader, then print the comparison."""
    from app.evals.client import compare_job, read_criteria, report

    client = _client(base_url, api_key)
    result = _client_call(lambda: compare_job(client, job_id, file=file, models=model or [],
                                              criteria=read_criteria(criterion or []), samples=samples,
                                              timeout_s=timeout, echo=typer.echo))
    typer.echo("\n" + report(client, result))
    _write_comparison(result, csv_out, per_item, json_out)


@evals_cli.command("compare")
def evals_compare(eval_id: str, run_ids: Annotated[list[str], typer.Argument(help="Two or more runs of the eval.")],
                  baseline: Annotated[str | None, typer.Option(help="The run the deltas are against (default the "
                                                                    "first).")] = None,
                  csv_out: CsvOut = None, per_item: PerItem = False, json_out: JsonOut = None,
                  base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Print two or more runs of an eval side by side: reward, pass rate, seconds, tokens and tool
    calls per item, tool calls per tool, and the per-item quadrants against the baseline."""
    from app.evals.client import comparison, report

    client = _client(base_url, api_key)
    result = _client_call(lambda: comparison(client, eval_id, run_ids, baseline))
    typer.echo(report(client, result))
    _write_comparison(result, csv_out, per_item, json_out)


@diagnostics_cli.command("show")
def diagnostics_show(diagnostic_id: str, base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Print a diagnostic's status, summary table and verdict."""
    from app.cli_client import format_diagnostic, format_diagnostic_progress, retrieve_diagnostic

    diagnostic = _client_call(lambda: retrieve_diagnostic(_client(base_url, api_key), diagnostic_id))
    typer.echo(format_diagnostic_progress(diagnostic))
    typer.echo(format_diagnostic(diagnostic))


@diagnostics_cli.command("rollouts")
def diagnostics_rollouts(diagnostic_id: str,
                         sample: Annotated[int | None, typer.Option(min=0, help="Only this sample (row index).")] = None,
                         limit: Annotated[int | None, typer.Option(min=1, help="At most N rollouts.")] = 20,
                         base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Print a diagnostic's rollouts (transcripts), by sample then run."""
    from app.cli_client import diagnostic_rollouts, format_transcript

    client = _client(base_url, api_key)
    for rollout in _client_call(lambda: diagnostic_rollouts(client, diagnostic_id, sample_index=sample, limit=limit)):
        typer.echo(format_transcript(rollout) + "\n")


@diagnostics_cli.command("cancel")
def diagnostics_cancel(diagnostic_id: str, base_url: BaseUrl = DEFAULT_BASE_URL, api_key: ApiKey = None) -> None:
    """Cancel a diagnostic that has not finished."""
    from app.cli_client import cancel_diagnostic

    diagnostic = _client_call(lambda: cancel_diagnostic(_client(base_url, api_key), diagnostic_id))
    typer.echo(f"{diagnostic['id']}  {diagnostic['status']}")


@cli.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(help="Model name, model directory or LoRA checkpoint directory.")],
    data: Annotated[Path, typer.Option(help="JSONL rows: messages, optional tools schemas, item fields.")],
    tools: Annotated[Path, typer.Option(help="JSON list of {name, server_url, headers?, parameters?}.")],
    grader: Annotated[Path, typer.Option(help="Grader JSON, as in method.reinforcement.grader.")],
    n: Annotated[int, typer.Option(min=1, help="Rollouts per row.")] = 1,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first LIMIT rows.")] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    max_episode_steps: Annotated[int, typer.Option(min=1, help="Tool-call budget per rollout.")] = 10,
    max_tokens_per_turn: Annotated[int, typer.Option(min=1)] = 256,
    max_tokens_per_rollout: Annotated[int, typer.Option(min=1)] = 2048,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report and rollouts here.")] = None,
    dtype: DType = Precision.auto,
) -> None:
    """Evaluate MODEL (before or after training): graded rollouts with the training engine."""
    _require_extra("worker", "eval", WORKER_PACKAGES)
    from workers.commands.eval_command import eval_command
    from workers.models.registry import ModelError
    from workers.engine.rollout import EngineConfig
    from workers.commands.rollout_command import RolloutInputError

    config = EngineConfig(max_episode_steps=max_episode_steps, max_tokens_per_turn=max_tokens_per_turn,
                          max_tokens_per_rollout=max_tokens_per_rollout, temperature=temperature)
    try:
        eval_command(model=model, data=data, tools_path=tools, grader_path=grader, n=n, limit=limit, config=config,
                     settings=get_settings(), json_out=json_out, echo=typer.echo, dtype=dtype.value)
    except (RolloutInputError, ModelError, OSError) as exc:
        _fail(str(exc))


@cli.command()
def demo(
    model: Annotated[str | None, typer.Option(help="Model to train (default: examples/financial_reports/demo_config.py).")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Reinforcement steps (default: demo_config).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A tiny model and one step per job: a smoke run in minutes.")] = False,
    workdir: Annotated[Path, typer.Option(help="Work directory, wiped at start (only one the demo made).")] = Path(".agent-rft-demo"),
    seed: Annotated[int | None, typer.Option(help="Data and training seed.")] = None,
) -> None:
    """Agent RFT's lesson end to end, on the embedded default: a starting agent that over-browses (supervised),
    then reinforcement fine-tuning that makes it go straight to the answer; prints a before/after table."""
    _require_extra("worker", "demo", WORKER_PACKAGES)  # the worker extra includes the inference server's
    from examples.financial_reports.demo import run_demo

    sys.exit(run_demo(model=model, steps=steps, quick=quick, workdir=workdir, seed=seed))


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
