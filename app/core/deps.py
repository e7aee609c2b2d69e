"""`Annotated` dependency aliases shared by the routers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
from fastapi import BackgroundTasks, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.auth.service import Principal, authenticate
from app.core.bearer import bearer_token, same_secret
from app.core.config import Settings
from app.core.db import end_session
from app.core.errors import APIError


class _RequestDatabase:
    """A request's session and its turn at the database, closed (and given back) once."""

    def __init__(self, session: Session, give_back: Callable[[], None]) -> None:
        self.session, self.give_back, self.open = session, give_back, True

    async def close(self, *, commit: bool) -> None:
        if not self.open:
            return
        self.open = False
        try:
            # Shielded: a client that hangs up must not leave the connection checked out.
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(end_session, self.session, commit=commit)
        finally:
            self.give_back()


async def _session(request: Request) -> AsyncIterator[Session]:
    """The request's one transaction (commit on success, roll back on any error), opened once the
    request has its turn at the database (app/core/admission.py) and closed before the turn is
    given back."""
    give_back = await request.app.state.database_turns.take()
    database = _RequestDatabase(request.app.state.session_factory(), give_back)
    request.state.database = database
    try:
        yield database.session
    except BaseException:
        await database.close(commit=False)
        raise
    await database.close(commit=True)


async def done_with_database(request: Request) -> None:
    """Commit and close the request's session now, and give back its turn at the database: what
    a route calls before it waits on a slow peer (the inference server, a grader), so that the wait
    holds neither a connection nor a turn. The route must not use the session afterwards."""
    database = getattr(request.state, "database", None)
    if database is not None:
        await database.close(commit=True)


def after_response(background: BackgroundTasks, request: Request, work: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> None:
    """Run `work(*args, **kwargs)` (synchronous; it opens its own sessions) once the response is sent, so after
    the request's commit, in its own turn at the database: work a burst of requests leaves behind
    (file validations, hand-offs to the broker) never takes the connections the requests need."""
    background.add_task(_in_its_turn, request, work, *args, **kwargs)


async def in_own_transaction(request: Request, work: Callable[..., Any], **kwargs: Any) -> Any:
    """`work(session=..., **kwargs)` in a transaction of its own, in its own turn at the database
    (waited for as long as it takes): what a route runs after it gave its turn back, e.g. storing
    what the model answered."""
    factory = request.app.state.session_factory

    def run() -> Any:
        with factory.begin() as session:
            return work(session=session, **kwargs)

    return await _in_its_turn(request, run)


async def _in_its_turn(request: Request, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`work(*args, **kwargs)` on the thread pool once a turn at the database is free, however long that takes."""
    give_back = await request.app.state.database_turns.take(patient=True)
    try:
        return await run_in_threadpool(work, *args, **kwargs)
    finally:
        give_back()


def _settings(request: Request) -> Settings:
    return request.app.state.settings


# The largest value an INTEGER column holds (PostgreSQL, SQLite's range is wider): a query filter
# beyond it can match nothing, and PostgreSQL refuses it ("integer out of range") as a 500.
INT32_MAX = 2**31 - 1
# A step or sample number in a query string.
RowIndex = Annotated[int, Query(ge=0, le=INT32_MAX)]

# scope="function": commit before the response is sent, so a 200 always means "stored".
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
