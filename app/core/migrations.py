"""Alembic owns the schema. These helpers run it programmatically and check the revision."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import make_url
from sqlalchemy.engine import Engine

import migrations

SCRIPT_LOCATION = Path(migrations.__file__).parent


class SchemaNotReady(RuntimeError):
    pass


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    _ensure_sqlite_dir(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    return ScriptDirectory(str(SCRIPT_LOCATION)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _ensure_sqlite_dir(url: str) -> None:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def ensure_schema(engine: Engine, *, auto_migrate: bool) -> None:
    """Refuse to serve an unmigrated or outdated database (or migrate it, when told to)."""
    url = engine.url.render_as_string(hide_password=False)
    if auto_migrate:
        upgrade(url)
        return
    _ensure_sqlite_dir(url)
    current, head = current_revision(engine), head_revision()
    if current != head:
        state = "has no schema yet" if current is None else f"is at schema revision {current}"
        raise SchemaNotReady(
            f"The database {engine.url.render_as_string(hide_password=True)} {state}; this version of agent-rft "
            f"needs revision {head}. Run `agent-rft db upgrade` (or set AGENT_RFT_AUTO_MIGRATE=true to migrate on start)."
        )
