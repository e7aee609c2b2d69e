"""The installed `agent-rft` command, run as a user runs it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg

from tests.conftest import REDIS_URL, fresh_pg_database, free_port, wait_for

AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
KEY = re.compile(r"^sk-[A-Za-z0-9_-]{40,}$", re.M)


def run(*args: str, env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([AGENT_RFT, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"])


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AGENT_RFT_DATA_DIR": str(tmp_path / "data"), **extra}


def test_projects_and_keys_on_postgres(tmp_path):
    with fresh_pg_database() as url:
        env = cli_env(tmp_path, AGENT_RFT_DATABASE_URL=url)
        refused = run("projects", "create", "acme", env=env)
        assert refused.returncode == 1 and "agent-rft db upgrade" in refused.stderr

        assert run("db", "upgrade", env=env).returncode == 0
        created = run("projects", "create", "acme", env=env)
        assert created.returncode == 0, created.stderr
        first_key = KEY.search(created.stdout).group(0)
        assert "shown once" in created.stdout

        duplicate = run("projects", "create", "acme", env=env)
        assert duplicate.returncode == 1 and "already exists" in duplicate.stderr
        assert run("keys", "create", "--project", "nope", env=env).returncode == 1

        second = run("keys", "create", "--project", "acme", env=env)
        second_key = KEY.search(second.stdout).group(0)
        assert second_key != first_key

        # Stored hashed: no column of any row holds the key or a recognisable part of it.
        with psycopg.connect(url) as conn:
            dump = str(conn.execute("SELECT * FROM api_keys").fetchall())
        assert first_key not in dump and second_key not in dump and first_key[10:30] not in dump

        from app.core.migrations import head_revision

        current = run("db", "current", env=env)
        assert f"current: {head_revision()}" in current.stdout


def test_serve_then_use_the_printed_key(tmp_path):
    env = cli_env(tmp_path)  # the embedded SQLite default
    assert run("db", "upgrade", env=env).returncode == 0
    key = KEY.search(run("projects", "create", "demo", env=env).stdout).group(0)
    port = free_port()
    server = subprocess.Popen([AGENT_RFT, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{base}/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=60, interval=0.2)
        assert httpx.get(f"{base}/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{base}/v1/files", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert "/v1/fine_tuning/jobs" in httpx.get(f"{base}/openapi.json").json()["paths"]
        assert httpx.get(f"{base}/docs").status_code == 200
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=20)


def test_worker_starts_and_consumes_its_queue(tmp_path, redis_client):
    queue = f"test-worker-{os.getpid()}-{time.monotonic_ns()}"
    env = cli_env(tmp_path, AGENT_RFT_BROKER_URL=REDIS_URL)
    worker = subprocess.Popen([AGENT_RFT, "worker", "--queues", queue, "--loglevel", "info"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []

        def ready() -> bool:
            line = worker.stdout.readline()
            lines.append(line)
            return "ready" in line or worker.poll() is not None

        wait_for(ready, timeout=90, interval=0)
        output = "".join(lines)
        assert worker.poll() is None, output
        assert queue in output  # the worker announces the queue it consumes
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        redis_client.delete(queue)
