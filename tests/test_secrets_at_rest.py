"""Secrets at rest (docs/security.md#secrets-at-rest): tool headers, grader headers and webhook
signing secrets are stored encrypted, so what a database dump holds reveals none of them; the
worker that claims a run still gets the headers, deliveries are still signed with the secret, the
API (and the dashboard) masks them;
keys rotate (old rows read under "new,old", then `agent-rft secrets reencrypt`, then "new"
alone); a deployment without a key refuses to start and says why."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import insert, select, text

from app.core.config import Settings, get_settings
from app.core.crypto import SecretKeysMissing, SecretUnreadable, secret_box
from app.core.db import make_engine, make_session_factory, utcnow
from app.core.migrations import downgrade, upgrade
from app.jobs.tool_headers import open_headers
from app.main import create_app
from app.models import Base, Diagnostic, Job, Project
from app.secrets_at_rest import decrypt as decrypt_all
from app.secrets_at_rest import reencrypt as reencrypt_all
from tests.conftest import Api, fresh_pg_database, job_body, question_rows, wait_for
from tests.dashboard.helpers import login
from tests.test_internal import Worker
from tests.webhook_helpers import receiver

TOOL_SECRET = "Bearer tool-secret-abcdef123456"  # what job_body sends to the tool server
GRADER_SECRET = "Bearer grader-secret-XYZ-0123456789"  # what an endpoint grader sends to its server
NESTED_SECRET = "Bearer grader-secret-nested-abcd9876"  # the same, from inside a multi grader
JOBS = "/v1/fine_tuning/jobs"
AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
DIAGNOSTICS = "/v1/fine_tuning/alpha/diagnostics"


def database_dump(url: str) -> str:
    """Every row of every table as text: what `pg_dump --data-only` would write, in JSON."""
    with psycopg.connect(url) as conn:
        return "\n".join(str(row[0]) for table in Base.metadata.sorted_tables
                         for row in conn.execute(f'SELECT row_to_json(t)::text FROM "{table.name}" t'))


def with_keys(settings: Settings, *keys: str) -> Settings:
    return settings.model_copy(update={"secret_keys": [SecretStr(k) for k in keys]})


@pytest.fixture
def settings(settings, redis_client):  # noqa: ANN001, ANN201
    # Webhook deliveries go to a queue of their own (no worker consumes it: the tests claim them).
    settings = settings.model_copy(update={"webhook_queue": f"test-webhooks-{uuid.uuid4().hex[:8]}",
                                           "watchdog_interval_s": 3600})
    yield settings
    redis_client.delete(settings.webhook_queue)


def endpoint_grader(secret: str) -> dict[str, Any]:
    return {"type": "endpoint", "name": "judge", "url": "http://127.0.0.1:9/grade", "headers": {"Authorization": secret}}


def multi_grader(secret: str) -> dict[str, Any]:
    """An endpoint grader nested in a multi grader, beside one that has no headers."""
    exact = job_body("file-x")["method"]["reinforcement"]["grader"]
    return {"type": "multi", "name": "both", "calculate_output": "0.5 * judge + 0.5 * exact",
            "graders": {"judge": endpoint_grader(secret), "exact": exact}}


def queued_job(api: Api, grader: dict[str, Any] | None = None) -> str:
    file_id = api.upload_ok(question_rows())
    created = api.post(JOBS, json=job_body(file_id, reinforcement={"grader": grader} if grader else {}))
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    wait_for(lambda: api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued")
    return job_id


def claimed_reinforcement(client: TestClient, settings: Settings, path: str, key: str) -> dict[str, Any]:
    """`method.reinforcement` in the answer to a worker's claim of `path` (a job or a diagnostic)."""
    claim = Worker(client, settings.worker_token.get_secret_value()).call("POST", f"{path}/claim",
                                                                          {"worker_id": "gpu-1"})
    assert claim.status_code == 200, claim.text
    return claim.json()[key]["method"]["reinforcement"]


def claimed_headers(client: TestClient, settings: Settings, path: str, key: str) -> dict[str, str]:
    """The tool headers in the answer to a worker's claim of `path` (a job or a diagnostic)."""
    return claimed_reinforcement(client, settings, path, key)["tools"][0]["headers"]


def endpoint(api: Api, url: str) -> dict[str, Any]:
    created = api.post("/v1/webhook_endpoints", json={"name": "r", "url": url, "event_types": ["fine_tuning.job.cancelled"]})
    assert created.status_code == 200, created.text
    return created.json()


def test_tool_headers_are_sealed_in_the_database_masked_by_the_api_and_open_for_the_worker(api, client, settings):
    job_id = queued_job(api)
    diagnostic = api.post(DIAGNOSTICS, json=job_body(api.upload_ok(question_rows())))
    assert diagnostic.status_code == 200, diagnostic.text
    diag_id = diagnostic.json()["id"]

    dump = database_dump(settings.database_url)
    assert "tool-secret-abcdef123456" not in dump and "fernet:" in dump
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["method"]["reinforcement"]["tools"][0]["headers"] == {
        "Authorization": "****3456"}
    assert api.get(f"{DIAGNOSTICS}/{diag_id}").json()["method"]["reinforcement"]["tools"][0]["headers"] == {
        "Authorization": "****3456"}

    assert claimed_headers(client, settings, f"/jobs/{job_id}", "job") == {"Authorization": TOOL_SECRET}
    wait_for(lambda: api.get(f"{DIAGNOSTICS}/{diag_id}").json()["status"] == "queued")
    assert claimed_headers(client, settings, f"/diagnostics/{diag_id}", "diagnostic") == {"Authorization": TOOL_SECRET}


def test_grader_headers_are_sealed_in_the_database_masked_in_every_answer_and_open_for_the_worker(
        api, client, project, settings):
    job_id = queued_job(api, multi_grader(NESTED_SECRET))
    created = api.post(DIAGNOSTICS, json=job_body(api.upload_ok(question_rows()),
                                                  reinforcement={"grader": endpoint_grader(GRADER_SECRET)}))
    assert created.status_code == 200, created.text
    diag_id = created.json()["id"]
    wait_for(lambda: api.get(f"{DIAGNOSTICS}/{diag_id}").json()["status"] == "queued")

    assert "grader-secret" not in database_dump(settings.database_url)
    job = api.get(f"{JOBS}/{job_id}").json()
    assert job["method"]["reinforcement"]["grader"]["graders"]["judge"]["headers"] == {"Authorization": "****9876"}
    diagnostic = api.get(f"{DIAGNOSTICS}/{diag_id}").json()
    assert diagnostic["method"]["reinforcement"]["grader"]["headers"] == {"Authorization": "****6789"}
    login(client, project["key"])
    answers = {
        "create": created.text, "retrieve": api.get(f"{JOBS}/{job_id}").text, "list": api.get(JOBS).text,
        "events": api.get(f"{JOBS}/{job_id}/events").text, "diagnostic": api.get(f"{DIAGNOSTICS}/{diag_id}").text,
        "diagnostics": api.get(DIAGNOSTICS).text,
        "validate": api.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": multi_grader(NESTED_SECRET)}).text,
        "dashboard job": client.get(f"/dashboard/jobs/{job_id}").text,
        "dashboard diagnostic": client.get(f"/dashboard/diagnostics/{diag_id}").text,
    }
    assert [name for name, answer in answers.items() if "grader-secret" in answer] == []
    assert "****9876" in answers["validate"]

    claimed = claimed_reinforcement(client, settings, f"/jobs/{job_id}", "job")
    assert claimed["grader"]["graders"]["judge"]["headers"] == {"Authorization": NESTED_SECRET}
    claimed = claimed_reinforcement(client, settings, f"/diagnostics/{diag_id}", "diagnostic")
    assert claimed["grader"]["headers"] == {"Authorization": GRADER_SECRET}


def test_webhook_secrets_are_sealed_in_the_database_and_deliveries_still_signed(api, client, settings):
    with receiver() as recv:
        created = endpoint(api, recv.url)
        first = recv.secret = created["signing_secret"]
        assert created["signing_secret_hint"] == f"whsec_****{first[-4:]}"
        assert first not in database_dump(settings.database_url)

        # A real delivery: the worker's claim answer carries the request, signed with the secret.
        job_id = queued_job(api)
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
        delivery = wait_for(lambda: api.get(f"/v1/webhook_endpoints/{created['id']}/deliveries").json()["data"])[0]
        worker = Worker(client, settings.worker_token.get_secret_value())
        claim = worker.call("POST", f"/webhook_deliveries/{delivery['id']}/claim", {"worker_id": "w-1"}).json()
        assert claim["action"] == "send", claim
        event = recv.verify(claim["attempt"]["body"].encode(), claim["attempt"]["headers"], first)
        assert event.type == "fine_tuning.job.cancelled"

        # Rotation keeping the old secret: both stay sealed, the test send carries both signatures.
        rotated = api.post(f"/v1/webhook_endpoints/{created['id']}/rotate_secret",
                           json={"keep_old_secret_active_for_24_hours": True}).json()
        second = recv.secret = rotated["signing_secret"]
        dump = database_dump(settings.database_url)
        assert first not in dump and second not in dump
        assert api.get(f"/v1/webhook_endpoints/{created['id']}").json()["signing_secret_hint"] == f"whsec_****{second[-4:]}"
        sent = api.post(f"/v1/webhook_endpoints/{created['id']}/test", json={"event_type": "fine_tuning.job.succeeded"})
        assert sent.status_code == 200 and sent.json()["success"], sent.text
        last = recv.requests[-1]
        for secret in (first, second):
            recv.verify(last.body, last.headers, secret)


def reencrypt(settings: Settings, keys: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(settings.data_dir), "AGENT_RFT_DATABASE_URL": settings.database_url,
           "AGENT_RFT_SECRET_KEYS": keys, "AGENT_RFT_DATA_DIR": str(settings.data_dir)}
    return subprocess.run([AGENT_RFT, "secrets", "reencrypt"], env=env, capture_output=True, text=True, timeout=120)


def sealed_column(url: str, endpoint_id: str) -> str:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT signing_secret FROM webhook_endpoints WHERE id = %s", (endpoint_id,)).fetchone()[0]


def claimed_job_headers(client: TestClient, settings: Settings, job_id: str) -> tuple[dict, dict]:
    """The tool's and the (multi_grader's) endpoint grader's headers a worker's claim of the job answers."""
    claimed = claimed_reinforcement(client, settings, f"/jobs/{job_id}", "job")
    return claimed["tools"][0]["headers"], claimed["grader"]["graders"]["judge"]["headers"]


def test_keys_rotate_old_rows_read_under_both_keys_then_reencrypt_leaves_the_new_key_enough(settings, project):
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    plain = ({"Authorization": TOOL_SECRET}, {"Authorization": NESTED_SECRET})
    with TestClient(create_app(with_keys(settings, key_a))) as client, receiver() as recv:
        api = Api(client, project["key"])
        job_id, legacy_job_id = queued_job(api, multi_grader(NESTED_SECRET)), queued_job(api, multi_grader(NESTED_SECRET))
        hook, legacy_hook = endpoint(api, recv.url), endpoint(api, recv.url)
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        # Rows as revision 0006 stored them, in plain text: read as they are until reencrypt seals them.
        legacy_method = job_body("file-x", reinforcement={"grader": multi_grader(NESTED_SECRET)})["method"]
        conn.execute("UPDATE jobs SET method = %s::jsonb WHERE id = %s", (json.dumps(legacy_method), legacy_job_id))
        conn.execute("UPDATE webhook_endpoints SET signing_secret = %s WHERE id = %s",
                     (legacy_hook["signing_secret"], legacy_hook["id"]))

    with TestClient(create_app(with_keys(settings, key_b, key_a))) as client:  # B is new, A still opens
        for job in (job_id, legacy_job_id):
            assert claimed_job_headers(client, settings, job) == plain

    done = reencrypt(settings, f"{key_b},{key_a}")
    assert done.returncode == 0, done.stderr
    # The job sealed under A and the legacy one, a tool's and a grader's header each; the endpoint
    # under A and the legacy one.
    assert "Re-encrypted 4 header values (of tools and graders) and 2 webhook signing secrets." in done.stdout, done.stdout
    again = reencrypt(settings, f"{key_b},{key_a}")
    assert "Re-encrypted 0 header values (of tools and graders) and 0 webhook signing secrets." in again.stdout, again.stderr

    only_b, only_a = with_keys(settings, key_b), with_keys(settings, key_a)
    with pytest.raises(SecretUnreadable, match="AGENT_RFT_SECRET_KEYS"):
        secret_box(only_a).open(sealed_column(settings.database_url, hook["id"]))
    with TestClient(create_app(only_b)) as client, receiver() as recv:
        api = Api(client, project["key"])
        for job in (job_id, legacy_job_id):
            assert claimed_job_headers(client, only_b, job) == plain
        for created in (hook, legacy_hook):
            recv.secret = created["signing_secret"]
            assert api.post(f"/v1/webhook_endpoints/{created['id']}", json={"url": recv.url}).status_code == 200
            sent = api.post(f"/v1/webhook_endpoints/{created['id']}/test", json={"event_type": "fine_tuning.job.succeeded"})
            assert sent.status_code == 200 and sent.json()["success"], sent.text
    dump = database_dump(settings.database_url)
    assert "tool-secret-abcdef123456" not in dump and legacy_hook["signing_secret"] not in dump
    assert "grader-secret" not in dump



def test_an_evals_grader_and_its_runs_tool_headers_are_sealed_masked_open_for_the_worker_and_reencrypted(
        settings, project):
    key_a, key_b = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    with TestClient(create_app(with_keys(settings, key_a))) as client:
        api = Api(client, project["key"])
        created = api.post("/v1/evals", json={"data_source_config": {"type": "custom", "item_schema": {}},
                                              "testing_criteria": [endpoint_grader(GRADER_SECRET)]})
        assert created.status_code == 200, created.text
        eval_id = created.json()["id"]
        run = api.post(f"/v1/evals/{eval_id}/runs", json={"data_source": {
            "type": "completions", "model": "tiny-smollm2", "source": {"type": "file_content", "content": [{"item": {}}]},
            "input_messages": {"type": "template", "template": [{"role": "user", "content": "hi"}]},
            "x_open_model": {"tools": job_body("file-x")["method"]["reinforcement"]["tools"]}}})
        assert run.status_code == 200, run.text
        answers = [created.text, run.text, api.get(f"/v1/evals/{eval_id}").text, api.get(f"/v1/evals/{eval_id}/runs").text]
    assert not [a for a in answers if "grader-secret" in a or "tool-secret" in a]
    assert "****6789" in answers[0] and "****3456" in answers[1]
    dump = database_dump(settings.database_url)
    assert "grader-secret" not in dump and "tool-secret" not in dump

    done = reencrypt(settings, f"{key_b},{key_a}")
    assert "Re-encrypted 2 header values (of tools and graders)" in done.stdout, (done.stdout, done.stderr)
    with TestClient(create_app(with_keys(settings, key_b))) as client:  # key A is gone: everything is under B
        claim = Worker(client, settings.worker_token.get_secret_value()).call(
            "POST", f"/eval_runs/{run.json()['id']}/claim", {"worker_id": "gpu-1"})
    assert claim.status_code == 200, claim.text
    claimed = claim.json()["run"]
    assert claimed["testing_criteria"][0]["headers"] == {"Authorization": GRADER_SECRET}
    assert claimed["data_source"]["x_open_model"]["tools"][0]["headers"] == {"Authorization": TOOL_SECRET}

def test_postgres_without_a_key_refuses_to_start_and_says_what_to_set(settings, monkeypatch, tmp_path):
    monkeypatch.delenv("AGENT_RFT_SECRET_KEYS", raising=False)
    keyless = Settings(_env_file=None, data_dir=tmp_path, database_url=settings.database_url)
    with pytest.raises(SecretKeysMissing, match="AGENT_RFT_SECRET_KEYS is not set.*agent-rft secrets generate-key"):
        create_app(keyless)
    served = subprocess.run([AGENT_RFT, "serve", "--port", "1"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                            env={"PATH": os.environ["PATH"], "AGENT_RFT_DATABASE_URL": settings.database_url,
                                 "AGENT_RFT_DATA_DIR": str(tmp_path)})
    assert served.returncode == 1 and "AGENT_RFT_SECRET_KEYS is not set" in served.stderr, served.stderr
    assert not (tmp_path / "secret.key").exists()

    with pytest.raises(SecretKeysMissing, match="key 2 of 2 is not a Fernet key") as refused:
        create_app(with_keys(keyless, Fernet.generate_key().decode(), "not-a-key-at-all"))
    assert "not-a-key-at-all" not in str(refused.value)


def test_the_embedded_default_generates_its_key_once_readable_by_its_owner_only(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENT_RFT_SECRET_KEYS", raising=False)
    embedded = Settings(_env_file=None, data_dir=tmp_path / "data")
    sealed = secret_box(embedded).seal("whsec_abc")
    key_file = tmp_path / "data" / "secret.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert secret_box(Settings(_env_file=None, data_dir=tmp_path / "data")).open(sealed) == "whsec_abc"
    assert Fernet(key_file.read_text().strip())  # a plain Fernet key an operator can move to the setting


@contextmanager
def database(backend: str, tmp_path: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'agent_rft.sqlite3'}"
        return
    with fresh_pg_database() as url:
        yield url.replace("postgresql://", "postgresql+psycopg://")


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_revision_0007_keeps_plain_secrets_readable_and_goes_back_only_once_they_are_plain_again(backend, tmp_path):
    legacy = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    box = secret_box(with_keys(Settings(_env_file=None, data_dir=tmp_path), Fernet.generate_key().decode()))
    with database(backend, tmp_path) as url:
        upgrade(url, "0006")
        engine = make_engine(url)
        try:
            with engine.begin() as conn:  # an endpoint as revision 0006 stored it
                conn.execute(text("INSERT INTO projects (id, name, created_at) VALUES ('proj_1', 'p', :now)"),
                             {"now": utcnow()})
                conn.execute(text(
                    "INSERT INTO webhook_endpoints (id, project_id, name, url, event_types, signing_secret, created_at,"
                    " updated_at) VALUES ('we_1', 'proj_1', 'r', 'http://127.0.0.1:9/hook', '[]', :secret, :now, :now)"),
                    {"secret": legacy, "now": utcnow()})
            upgrade(url)
            read = "SELECT signing_secret, signing_secret_hint FROM webhook_endpoints"
            with engine.connect() as conn:
                assert conn.execute(text(read)).one() == (legacy, f"whsec_****{legacy[-4:]}")

            factory = make_session_factory(engine)
            assert reencrypt_all(factory, box).webhook_secrets == 1
            with engine.connect() as conn:
                sealed = conn.execute(text(read)).one()[0]
            assert legacy not in sealed and box.open(sealed) == legacy
            with pytest.raises(RuntimeError, match="agent-rft secrets decrypt"):
                downgrade(url, "0006")
            upgrade(url)  # SQLite kept the later revisions' downgrades that ran first; PostgreSQL rolled back
            assert decrypt_all(factory, box).webhook_secrets == 1
            downgrade(url, "0006")
            with engine.connect() as conn:
                assert conn.execute(text("SELECT signing_secret FROM webhook_endpoints")).scalar() == legacy
        finally:
            engine.dispose()


def stored_methods(engine: Any) -> dict[str, dict[str, Any]]:
    """Every job's and diagnostic's stored `method`, by id."""
    with make_session_factory(engine).begin() as session:
        return {row_id: method for model in (Job, Diagnostic) for row_id, method in session.execute(
            select(model.id, model.method))}


@pytest.fixture
def settings_key(monkeypatch) -> Iterator[str]:  # noqa: ANN001
    """A new key in AGENT_RFT_SECRET_KEYS, as get_settings() reads it: the settings a migration gets
    its key from, as `agent-rft db upgrade` does (get_settings may cache them: forgotten before and after)."""
    key = Fernet.generate_key().decode()
    monkeypatch.setenv("AGENT_RFT_SECRET_KEYS", key)
    forget = getattr(get_settings, "cache_clear", lambda: None)
    forget()
    yield key
    forget()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_revision_0010_seals_grader_headers_stored_in_plain_text_and_going_back_opens_them(backend, tmp_path,
                                                                                           settings_key):
    key = settings_key
    box = secret_box(with_keys(Settings(_env_file=None, data_dir=tmp_path), key))
    # Methods as revision 0009 stored them: tool headers sealed (not here: reencrypt's job), grader headers plain.
    plain = {"ftjob-1": job_body("file-x", reinforcement={"grader": multi_grader(NESTED_SECRET)})["method"],
             "diag-1": job_body("file-x", reinforcement={"grader": endpoint_grader(GRADER_SECRET)})["method"]}
    with database(backend, tmp_path) as url:
        upgrade(url, "0009")
        engine = make_engine(url)
        try:
            # Core inserts of the columns named (and those with defaults): head's tables have columns
            # that revision 0009 lacks (0012's), which an ORM insert would name.
            with make_session_factory(engine).begin() as session:
                session.execute(insert(Project.__table__).values(id="proj_1", name="p"))
                session.execute(insert(Job.__table__).values(
                    id="ftjob-1", project_id="proj_1", model="m", training_file="file-x", status="queued",
                    method=plain["ftjob-1"], seed=1))
                session.execute(insert(Diagnostic.__table__).values(
                    id="diag-1", project_id="proj_1", model="m", training_file="file-x", status="queued",
                    method=plain["diag-1"], runs_per_sample=2, seed=1))
            upgrade(url)
            sealed = stored_methods(engine)
            assert "grader-secret" not in json.dumps(sealed)
            assert sealed["ftjob-1"]["reinforcement"]["grader"]["graders"]["judge"]["headers"]["Authorization"][
                "mask"] == "****9876"
            assert sealed["ftjob-1"]["reinforcement"]["tools"] == plain["ftjob-1"]["reinforcement"]["tools"]
            assert {row_id: open_headers(method, box) for row_id, method in sealed.items()} == plain

            downgrade(url, "0009")
            assert stored_methods(engine) == plain
        finally:
            engine.dispose()
