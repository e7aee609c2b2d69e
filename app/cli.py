"""`agent-rft`: run migrations, manage projects and keys, serve the API, start workers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from app.core.config import get_settings

cli = typer.Typer(help="agent-rft: reinforcement fine-tuning of open-weight agents.", no_args_is_help=True,
                  add_completion=False)
db_cli = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)
projects_cli = typer.Typer(help="Projects: every object belongs to one.", no_args_is_help=True)
keys_cli = typer.Typer(help="API keys of a project.", no_args_is_help=True)
cli.add_typer(db_cli, name="db")
cli.add_typer(projects_cli, name="projects")
cli.add_typer(keys_cli, name="keys")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


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


def _session():  # noqa: ANN202
    from app.core.db import make_engine, make_session_factory
    from app.core.migrations import SchemaNotReady, ensure_schema

    engine = make_engine(get_settings().resolved_database_url)
    try:
        ensure_schema(engine, auto_migrate=get_settings().auto_migrate)
    except SchemaNotReady as exc:
        _fail(str(exc))
    return make_session_factory(engine).begin()


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


@keys_cli.command("create")
def keys_create(project: Annotated[str, typer.Option("--project", help="Project name.")]) -> None:
    """Create another API key for a project and print it (once)."""
    from app.auth.service import ProjectError, create_key

    with _session() as session:
        try:
            created = create_key(session=session, project_name=project)
        except ProjectError as exc:
            _fail(str(exc))
    _print_key(created, "Created API key")


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default AGENT_RFT_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default AGENT_RFT_PORT).")] = None,
) -> None:
    """Run the control plane (REST API, OpenAPI docs at /docs)."""
    import uvicorn

    from app.core.db import make_engine
    from app.core.migrations import SchemaNotReady, ensure_schema
    from app.main import create_app

    settings = get_settings()
    try:
        ensure_schema(make_engine(settings.resolved_database_url), auto_migrate=settings.auto_migrate)
    except SchemaNotReady as exc:
        _fail(str(exc))
    uvicorn.run(create_app(settings), host=host or settings.host, port=port or settings.port)


@cli.command()
def worker(
    queues: Annotated[str | None, typer.Option(help="Comma-separated queues (default AGENT_RFT_TRAINING_QUEUE).")] = None,
    concurrency: Annotated[int, typer.Option(help="Tasks run at once.")] = 1,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "info",
) -> None:
    """Start a Celery worker for training jobs."""
    from workers.celery_app import celery_app

    queue_names = queues or get_settings().training_queue
    celery_app.worker_main(["worker", "-Q", queue_names, "-c", str(concurrency), "-l", loglevel, "-P", "solo"
                            if concurrency == 1 else "prefork"])


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
) -> None:
    """Run rollouts of MODEL against real tools and print transcripts and a summary table."""
    from workers.rl.models import ModelError
    from workers.rl.rollout import EngineConfig
    from workers.rl.rollout_command import RolloutInputError, rollout_command

    config = EngineConfig(max_episode_steps=max_episode_steps, max_tokens_per_turn=max_tokens_per_turn,
                          max_tokens_per_rollout=max_tokens_per_rollout, temperature=temperature, top_p=top_p)
    try:
        rollout_command(model=model, data=data, tools_path=tools, n=n, limit=limit, config=config,
                        allowlist=get_settings().outbound_allowlist, seed=seed, json_out=json_out, echo=typer.echo)
    except (RolloutInputError, ModelError, OSError) as exc:
        _fail(str(exc))


@cli.command()
def demo() -> None:
    """Walk through the control plane on the embedded default (the training demo comes later)."""
    from app.demo import run_demo

    sys.exit(run_demo())


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
