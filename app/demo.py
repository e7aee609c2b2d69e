"""`agent-rft demo`: the control plane on the embedded default (SQLite + an embedded broker),
driven with the official `openai` SDK exactly as a user would drive it."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import uvicorn

from app.auth.service import create_project
from app.core.config import Settings
from app.core.db import make_engine, make_session_factory
from app.core.migrations import upgrade
from app.main import create_app

DATA_DIR = Path(".agent-rft-demo")
TOOLS_URL = "http://127.0.0.1:8001/tools"  # nothing listens yet: no rollout runs in this walkthrough
QUESTIONS = {"What was ACME's 2023 revenue in $M?": "412.5",
             "What was ACME's 2023 operating margin in percent?": "18.2",
             "How many employees did Globex report at the end of 2022?": "1840",
             "What dividend per share did Initech pay in 2023, in $?": "1.12"}
ARGS = {"query": {"type": "string", "description": "Words to look for."},
        "path": {"type": "string", "description": "A report path, e.g. acme/2023/annual.txt."}}
TOOL_SCHEMAS = [{"type": "function", "function": {"name": name, "description": about, "parameters": {
    "type": "object", "properties": {arg: ARGS[arg]}, "required": [arg]}}}
    for name, about, arg in [("search", "Full-text search over the financial reports.", "query"),
                             ("list", "List the reports under a directory.", "path"),
                             ("cat", "Print one report.", "path")]]
GRADER = {"type": "multi", "name": "answer", "calculate_output": "max(exact, mentions)", "graders": {
    "exact": {"type": "string_check", "name": "exact", "operation": "eq",
              "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"},
    "mentions": {"type": "string_check", "name": "mentions", "operation": "ilike",
                 "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}}}


def _method(**hyperparameters: Any) -> dict[str, Any]:
    tools = [{"name": name, "server_url": TOOLS_URL, "headers": {"Authorization": "Bearer demo-secret-token"}}
             for name in ("search", "list", "cat")]
    return {"type": "reinforcement", "reinforcement": {
        "grader": GRADER, "tools": tools, "max_episode_steps": 10, "hyperparameters": hyperparameters}}


def _prepare(data_dir: Path) -> tuple[Settings, str]:
    shutil.rmtree(data_dir, ignore_errors=True)
    # All explicit: a stray AGENT_RFT_* variable or .env must not point the demo elsewhere.
    settings = Settings(_env_file=None, environment="dev", data_dir=data_dir.resolve(), database_url=None,
                        broker_url=None, storage_dir=None, outbound_allowlist=["127.0.0.1"], auto_migrate=True)
    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        key = create_project(session=session, name="demo").secret
    engine.dispose()
    return settings, key


def _start_server(settings: Settings) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held until the server takes the socket over
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="demo-server", daemon=True)
    thread.start()
    _wait(lambda: server.started or not thread.is_alive(), "the server to start")
    if not server.started:
        raise RuntimeError("the server did not start (see the log above)")
    return server, thread, sock.getsockname()[1]


def _wait(ready: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := ready()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return result


def _events(client: openai.OpenAI, job_id: str) -> list[Any]:
    return list(reversed(client.fine_tuning.jobs.list_events(job_id, limit=100).data))  # oldest first


def _wait_for_handoff(client: openai.OpenAI, job_id: str, count: int) -> None:
    """A queued job reaches the broker just after its status commits; wait for that event."""
    _wait(lambda: sum("task_id" in (e.data or {}) or e.level != "info" for e in _events(client, job_id)) >= count,
          "the hand-off to the training queue")


def _upload(client: openai.OpenAI, data_dir: Path) -> str:
    path = data_dir / "financial_reports.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}], "tools": TOOL_SCHEMAS,
                                        "reference_answer": a}) + "\n" for q, a in QUESTIONS.items()))
    with path.open("rb") as fh:
        file = client.files.create(file=fh, purpose="fine-tune")
    print(f"Uploaded {path.name}: {file.id} ({file.bytes} bytes, status {file.status})")
    return file.id


def _create_job(client: openai.OpenAI, file_id: str) -> str:
    job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=file_id,
                                         method=_method(compute_multiplier=1, batch_size=2),
                                         metadata={"demo": "financial-reports"})
    print(f"Created job {job.id}: status {job.status}")
    job = _wait(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status != "validating_files" and j,
                "file validation")
    if job.status != "queued":
        raise RuntimeError(f"the job did not pass validation: {job.status} {job.error}")
    print(f"Files validated: status {job.status}. The tools as the API shows them back:")
    for tool in job.method.reinforcement.model_extra["tools"]:  # agent fields are extras to the SDK's types
        print(f"  {tool['name']:<6} -> {tool['server_url']}  headers: {tool['headers']}")
    _wait_for_handoff(client, job.id, 1)
    return job.id


def _pause_resume_cancel(client: openai.OpenAI, job_id: str) -> None:
    for action in ("pause", "resume", "cancel"):
        print(f"{action:>6}: status {getattr(client.fine_tuning.jobs, action)(job_id).status}")
        if action == "resume":
            _wait_for_handoff(client, job_id, 2)
    print("Events, oldest first:")
    for event in _events(client, job_id):
        print(f"  [{event.level:<5}] {event.message}")
    print(f"Checkpoints: {len(client.fine_tuning.jobs.checkpoints.list(job_id).data)} (no training has run)")


def _bad_request(client: openai.OpenAI, file_id: str) -> None:
    try:
        client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=file_id,
                                       method=_method(compute_multiplier=99))
    except openai.BadRequestError as exc:
        print(f"A bad request (compute_multiplier=99) is refused and no job is created: HTTP {exc.status_code}\n"
              f"  code: {exc.code}\n  param: {exc.param}\n  message: {exc.body['message']}")
    else:
        raise RuntimeError("the out-of-range compute_multiplier was accepted")


def run_demo() -> int:
    print(f"agent-rft demo: the control plane on the embedded default (SQLite + embedded broker in {DATA_DIR}/)")
    server = None
    try:
        settings, key = _prepare(DATA_DIR)
        print("Migrated a fresh database; created project 'demo' and an API key (only its SHA-256 hash is stored).")
        server, thread, port = _start_server(settings)
        print(f"Serving the API on http://127.0.0.1:{port} (OpenAPI docs at /docs); the openai SDK from here on.\n")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        file_id = _upload(client, DATA_DIR)
        _pause_resume_cancel(client, _create_job(client, file_id))
        _bad_request(client, file_id)
    except Exception as exc:  # noqa: BLE001 - the demo reports any failure in one line
        print(f"\ndemo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
    print("\nServer stopped. The training demo (an agent learning to use real tools) is not built yet, "
          "so this walkthrough shows the control plane only.")
    return 0
