"""`Annotated` dependency aliases shared by the routers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.auth.service import Principal, authenticate
from app.core.bearer import bearer_token, same_secret
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
    if not header:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'.",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    token = bearer_token(header)
    principal = authenticate(session=session, secret=token) if token is not None else None
    if principal is None:
        raise APIError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    limiter = getattr(request.app.state, "rate_limiter", None)
    if limiter is not None:  # AGENT_RFT_API_RATE_LIMIT
        limiter.check(principal.key_id)
    return principal


CurrentKey = Annotated[Principal, Depends(_current_key)]


_worker_token = HTTPBearer(auto_error=False, scheme_name="WorkerToken",
                           description="The shared worker token, AGENT_RFT_WORKER_TOKEN.")


def require_worker(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_worker_token)]
) -> None:
    """The dependency of every `/internal/v1` router: the caller is a worker (the shared token,
    compared in constant time). Workers serve every project, so nothing here is project-scoped."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise APIError(401, "This API is for workers: send 'Authorization: Bearer <AGENT_RFT_WORKER_TOKEN>'.",
                       code="missing_worker_token", headers=challenge)
    expected = request.app.state.settings.worker_token.get_secret_value()
    if not same_secret(credentials.credentials, expected):
        raise APIError(401, "Incorrect worker token.", code="invalid_worker_token", headers=challenge)
