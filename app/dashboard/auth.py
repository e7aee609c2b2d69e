"""Dashboard sessions: log in once with an API key, then a signed, httponly cookie carries the
project id, the key's id (never the key) and a CSRF token that every state-changing form must
echo back. The key is checked again on every request, so revoking it ends its sessions."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import Response
from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlalchemy import select

from app.auth.models import ApiKey
from app.core.config import Settings
from app.core.deps import SessionDep

COOKIE = "agent_rft_dashboard"
COOKIE_PATH = "/dashboard"
CSRF_FIELD = "csrf_token"


class LoginRequired(Exception):
    """Raised by the page dependencies; answered with a redirect to the login page (or a 401
    for the JSON endpoints)."""

    def __init__(self, wants_json: bool) -> None:
        super().__init__("login required")
        self.wants_json = wants_json


class CsrfFailed(Exception):
    """A state-changing form arrived without this session's CSRF token."""


@dataclass(frozen=True)
class Visitor:
    """Whoever holds the cookie: `project_id` is None until they log in."""

    csrf: str
    project_id: str | None = None
    key_id: str | None = None


@dataclass(frozen=True)
class DashboardUser:
    project_id: str
    key_id: str
    csrf: str


@dataclass(frozen=True)
class Caller:
    """Who a logged-in dashboard request is for and whether its route answers JSON (the poll,
    the CSV) or a page: all that the dashboard's APIError handler needs to answer as the route
    would (router.answer_service_error)."""

    user: DashboardUser
    wants_json: bool


def caller_of(request: Request) -> Caller | None:
    """None until the login dependency has run: a request outside the dashboard, or one of its
    routes without a login (the login form, static files)."""
    return getattr(request.state, "dashboard_caller", None)


def _serializer(settings: Settings) -> URLSafeTimedSerializer:
    secret = settings.dashboard_secret
    if secret is not None:
        key = secret.get_secret_value()
    else:  # a key of its own, derived so that it never equals the worker token itself
        key = hmac.new(settings.worker_token.get_secret_value().encode(), b"agent-rft dashboard sessions",
                       hashlib.sha256).hexdigest()
    return URLSafeTimedSerializer(key, salt="agent-rft-dashboard-session")


def read_visitor(request: Request) -> Visitor | None:
    raw = request.cookies.get(COOKIE)
    if not raw:
        return None
    settings: Settings = request.app.state.settings
    try:
        data: Any = _serializer(settings).loads(raw, max_age=settings.dashboard_session_max_age_s)
    except BadSignature:  # also an expired one (SignatureExpired is a BadSignature)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("c"), str):
        return None
    return Visitor(csrf=data["c"], project_id=data.get("p"), key_id=data.get("k"))


def write_visitor(request: Request, response: Response, visitor: Visitor) -> None:
    settings: Settings = request.app.state.settings
    payload = {"c": visitor.csrf, "p": visitor.project_id, "k": visitor.key_id}
    response.set_cookie(
        COOKIE, _serializer(settings).dumps(payload), max_age=settings.dashboard_session_max_age_s,
        path=COOKIE_PATH, httponly=True, samesite="lax", secure=request.url.scheme == "https",
    )


def forget_visitor(response: Response) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="lax")


def new_visitor(project_id: str | None = None, key_id: str | None = None) -> Visitor:
    """A fresh CSRF token: a new one at login, so a token seen before login is useless after it."""
    return Visitor(csrf=secrets.token_urlsafe(32), project_id=project_id, key_id=key_id)


def check_csrf(visitor: Visitor | None, submitted: str | None) -> None:
    if visitor is None or not submitted or not hmac.compare_digest(visitor.csrf.encode(), submitted.encode()):
        raise CsrfFailed()


def key_is_live(session: Any, key_id: str, project_id: str) -> bool:
    stmt = select(ApiKey.id).where(ApiKey.id == key_id, ApiKey.project_id == project_id, ApiKey.revoked_at.is_(None))
    return session.scalar(stmt) is not None


def _user(request: Request, session: SessionDep, wants_json: bool) -> DashboardUser:
    visitor = read_visitor(request)
    if visitor is None or not visitor.project_id or not visitor.key_id \
            or not key_is_live(session, visitor.key_id, visitor.project_id):
        raise LoginRequired(wants_json)
    user = DashboardUser(project_id=visitor.project_id, key_id=visitor.key_id, csrf=visitor.csrf)
    request.state.dashboard_caller = Caller(user, wants_json)
    return user


def _page_user(request: Request, session: SessionDep) -> DashboardUser:
    return _user(request, session, wants_json=False)


def _data_user(request: Request, session: SessionDep) -> DashboardUser:
    return _user(request, session, wants_json=True)


PageUser = Annotated[DashboardUser, Depends(_page_user)]
DataUser = Annotated[DashboardUser, Depends(_data_user)]
