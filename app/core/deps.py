"""`Annotated` dependency aliases shared by the routers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Query, Request
from sqlalchemy.orm import Session

from app.auth.service import Principal, authenticate
from app.core.config import Settings
from app.core.db import session_scope
from app.core.errors import APIError


def _session(request: Request) -> Iterator[Session]:
    yield from session_scope(request.app.state.session_factory)


def _settings(request: Request) -> Settings:
    return request.app.state.settings


# scope="function": commit before the response is sent, so a 200 always means "stored".
# The largest value an INTEGER column holds (PostgreSQL, SQLite's range is wider): a query filter
# beyond it can match nothing, and PostgreSQL refuses it ("integer out of range") as a 500.
INT32_MAX = 2**31 - 1
# A step or sample number in a query string.
RowIndex = Annotated[int, Query(ge=0, le=INT32_MAX)]

SessionDep = Annotated[Session, Depends(_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(_settings)]


def _current_key(request: Request, session: SessionDep) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'.",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = authenticate(session=session, secret=token.strip()) if scheme.lower() == "bearer" else None
    if principal is None:
        raise APIError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


CurrentKey = Annotated[Principal, Depends(_current_key)]
