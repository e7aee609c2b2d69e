"""API keys as an operator manages them: listed by the CLI with their prefix
and dates but never the secret, revoked, given an expiry; a revoked or expired key answers 401
at once; and the per-key request rate limit on /v1, answered 429 with Retry-After."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.auth.service import create_key
from app.core.config import Settings
from app.core.db import make_engine, make_session_factory, utcnow
from app.main import create_app
from tests.conftest import make_project, serve_app
from tests.test_cli import KEY, cli_env, run

KEY_ID = re.compile(r"^(key_\S+)\s", re.M)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_cli_lists_revokes_and_expires_keys_and_the_api_follows_at_once(tmp_path, monkeypatch):
    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    env = cli_env(tmp_path)  # the embedded SQLite default, as `agent-rft serve` would use it
    assert run("db", "upgrade", env=env).returncode == 0
    first = KEY.search(run("projects", "create", "acme", env=env).stdout).group(0)
    second = KEY.search(run("keys", "create", "--project", "acme", env=env).stdout).group(0)
    expiring = run("keys", "create", "--project", "acme", "--expires-in-days", "30", env=env)
    assert expiring.returncode == 0 and "It expires at" in expiring.stdout
    third = KEY.search(expiring.stdout).group(0)

    settings = Settings(_env_file=None, data_dir=tmp_path / "data")
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/files", headers=_bearer(first)).status_code == 200

        listing = run("keys", "list", "--project", "acme", env=env)
        assert listing.returncode == 0, listing.stderr
        assert not any(key in listing.stdout or key[7:20] in listing.stdout for key in (first, second, third))
        rows = [line for line in listing.stdout.splitlines()[1:] if line.strip()]
        assert len(rows) == 3 and all(line.endswith("active") for line in rows)
        assert first[:7] in rows[0] and second[:7] in rows[1] and third[:7] in rows[2]
        assert rows[0].split()[4] != "-" and rows[1].split()[4] == "-"  # last used: only the first, just now
        assert rows[2].split()[6] != "-"  # the expiry date

        revoked_id = KEY_ID.findall(listing.stdout)[1]
        revoked = run("keys", "revoke", revoked_id, env=env)
        assert revoked.returncode == 0 and revoked_id in revoked.stdout
        answer = client.get("/v1/files", headers=_bearer(second))
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/files", headers=_bearer(first)).status_code == 200  # the others still work
        assert client.get("/v1/files", headers=_bearer(third)).status_code == 200
        assert run("keys", "list", "--project", "acme", env=env).stdout.splitlines()[2].endswith("revoked")
        unknown = run("keys", "revoke", "key_nope", env=env)
        assert unknown.returncode == 1 and "No API key with id 'key_nope'" in unknown.stderr


def test_an_expired_key_answers_401_from_the_moment_it_expires(api, client, settings, project):
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        soon = create_key(session=session, project_name=project["name"], expires_at=utcnow() + timedelta(seconds=1))
        past = create_key(session=session, project_name=project["name"], expires_at=utcnow() - timedelta(seconds=1))
    engine.dispose()
    assert client.get("/v1/files", headers=_bearer(soon.secret)).status_code == 200
    assert client.get("/v1/files", headers=_bearer(past.secret)).status_code == 401
    time.sleep(1.2)
    expired = client.get("/v1/files", headers=_bearer(soon.secret))
    assert expired.status_code == 401 and expired.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/files", headers=_bearer(project["key"])).status_code == 200


def test_each_key_is_rate_limited_with_retry_after_in_openais_shape(settings):
    limited = settings.model_copy(update={"api_rate_limit": "3/minute"})
    project = make_project(limited)
    engine = make_engine(limited.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        other = create_key(session=session, project_name=project["name"]).secret
    engine.dispose()
    with serve_app(create_app(limited)) as port:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=project["key"], max_retries=0)
        for _ in range(3):
            sdk.files.list()
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.files.list()
        response = refused.value.response
        assert 1 <= int(response.headers["retry-after"]) <= 60
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and error["param"] is None
        assert "3 per 1 minute" in error["message"]
        # Per key: another key of the same project has its own budget.
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=other, max_retries=0).files.list()


def test_a_rate_limit_that_is_not_one_is_refused_at_start_up():
    with pytest.raises(ValidationError, match="api_rate_limit"):
        Settings(_env_file=None, api_rate_limit="lots")

