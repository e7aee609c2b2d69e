"""The API's side of serving without a model: request checks before anything is forwarded, and an
inference server that is down, stuck or broken answering 503 with a clear message, never a hang."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.conftest import Api, free_port

CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(autouse=True)
def no_inference_server(settings) -> None:  # noqa: ANN001
    """Before the app is made: its inference server is a port where nothing listens."""
    settings.inference_url = f"http://127.0.0.1:{free_port()}"


@contextmanager
def fake_inference(behaviour: str) -> Iterator[str]:
    """A TCP server on 127.0.0.1 that accepts and then hangs ("stuck"), closes at once ("crash") or
    answers HTTP 500 with HTML ("broken")."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)
            if behaviour == "crash":
                conn.close()
            elif behaviour == "broken":
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/html\r\n"
                             b"Content-Length: 9\r\nConnection: close\r\n\r\n<h1>x</h1>")
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.parametrize("behaviour", ["stuck", "crash", "broken"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_broken_inference_server_is_a_503_within_the_timeout(settings, project, behaviour, stream):
    with fake_inference(behaviour) as url:
        app = create_app(settings.model_copy(update={"inference_url": url, "inference_timeout_s": 1.0}))
        with TestClient(app) as client:
            started = time.monotonic()
            answer = Api(client, project["key"]).post("/v1/chat/completions", json={**CHAT, "stream": stream})
            elapsed = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "inference_unavailable"
    assert url in answer.json()["error"]["message"]
    assert elapsed < 10


def test_requests_are_checked_before_they_are_forwarded(api):
    # No inference server runs: every answer here comes from the API's own checks.
    cases = [
        ({"messages": CHAT["messages"]}, 400, "missing_required_parameter", "model"),
        ({**CHAT, "messages": [{"role": "user"}]}, 400, "invalid_value", "messages"),
        ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]}]},
         400, "invalid_value", "messages"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "array"}}}]},
         400, "invalid_value", "tools"),
        ({**CHAT, "tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
        ({**CHAT, "stream_options": {"include_usage": True}}, 400, "invalid_value", "stream_options"),
        ({**CHAT, "frequency_penalty": 0.5}, 400, "unsupported_parameter", "frequency_penalty"),
        ({**CHAT, "best_of": 3}, 400, "unsupported_parameter", "best_of"),
        ({**CHAT, "model": "ft:SmolLM2-135M-Instruct:someone::ftjob-x"}, 404, "model_not_found", "model"),
        ({**CHAT, "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ]
    for body, status, code, param in cases:
        answer = api.post("/v1/chat/completions", json=body)
        assert answer.status_code == status, (body, answer.text)
        assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == (code, param), (body, answer.text)
    assert api.post("/v1/chat/completions", content=b"[1, 2", headers={"Content-Type": "application/json"}).status_code == 400
    no_key = api.client.post("/v1/chat/completions", json=CHAT)
    assert no_key.status_code == 401


def test_no_op_values_of_unsupported_fields_are_accepted(api):
    # They pass the checks and reach the (absent) inference server: 503, not 400.
    body = {**CHAT, "logprobs": False, "presence_penalty": 0, "response_format": {"type": "text"}, "store": False,
            "parallel_tool_calls": True, "user": "u-1"}
    answer = api.post("/v1/chat/completions", json=body)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "inference_unavailable"


def test_models_lists_the_deployments_base_models(api, settings):
    listed = api.get("/v1/models").json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == settings.inference_models
    assert all(m["owned_by"] == "agent-rft" and m["object"] == "model" for m in listed["data"])
    assert api.get("/v1/models/SmolLM2-135M-Instruct").json()["id"] == "SmolLM2-135M-Instruct"
    missing = api.get("/v1/models/ft:SmolLM2-135M-Instruct:x::ftjob-none")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
