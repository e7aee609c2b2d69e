"""Engine, sessions and the declarative base shared by every domain's models."""

from __future__ import annotations

from datetime import datetime, timezone

import math
import re
from typing import Any

from sqlalchemy import JSON, BigInteger, Integer, MetaData, Text, create_engine, event
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

def storable_json(value: Any) -> Any:
    """What PostgreSQL can store of a JSON value from outside: NaN and infinities are not JSON
    (JSONB refuses them) and become null; a NUL character (a random-weight model or a tool can
    produce one; JSONB and text refuse it) and an unpaired surrogate (a tool's `\\ud800` escape; it
    cannot be encoded as UTF-8) become U+FFFD, as a decoder does with a bad byte."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k) if isinstance(k, str) else k: storable_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable_json(v) for v in value]
    return value


# A surrogate code point: in a Python string, always an unpaired one (json.loads joins escaped pairs).
SURROGATE = re.compile("[\ud800-\udfff]")


def storable_text(value: str) -> str:
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    return SURROGATE.sub("\ufffd", value) if SURROGATE.search(value) else value


class StorableJSON(TypeDecorator):
    """JSONB on PostgreSQL (indexable, compact), plain JSON elsewhere; every value goes through
    storable_json, so what a worker, tool or grader sends can't fail the insert (and lose a push)."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect):  # noqa: ANN201
        return dialect.type_descriptor(JSONB() if dialect.name == "postgresql" else JSON())

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return storable_json(value)


class StorableText(TypeDecorator):
    """Text for strings that come from outside (event messages, receivers' responses): no NUL."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else storable_text(value)


JSONType = StorableJSON()
# SQLite only autoincrements INTEGER PRIMARY KEY; BIGINT elsewhere.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def unix(ts: datetime | None) -> int | None:
    """OpenAI objects carry Unix seconds; SQLite hands back naive datetimes, which are UTC here."""
    if ts is None:
        return None
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=timezone.utc)
    return int(ts.timestamp())


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """An engine whose pool opens at most `pool_size + max_overflow` connections (both kinds of database)."""
    pool = {"pool_size": pool_size, "max_overflow": max_overflow}
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # noqa: ANN001
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **pool)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def end_session(session: Session, *, commit: bool) -> None:
    """Commit (or roll back) and close: the connection goes back to the pool from the thread that
    ran this, and the session can be used no more."""
    try:
        if commit:
            session.commit()
        else:
            session.rollback()
    finally:
        session.close()
