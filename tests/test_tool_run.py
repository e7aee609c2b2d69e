"""`POST /v1/fine_tuning/alpha/tool/run` as OpenAI's Agent RFT harness calls it: the call reaches the
tool server as a rollout's would, and what fails is told apart (docs/tool-server.md)."""

from __future__ import annotations

import json

import httpx
import pytest

from agent_rft.tracing import w3c_trace_id
from tests.conftest import free_port, live_server
from tests.harness_tool_server import TOKEN, harness_tool_server


@pytest.fixture
def tool_run(settings, project):  # noqa: ANN001, ANN201
    with live_server(settings) as base, httpx.Client(base_url=base, timeout=60,
                                                     headers={"Authorization": f"Bearer {project['key']}"}) as http:
        yield lambda body: http.post("/v1/fine_tuning/alpha/tool/run", json=body)


def call(server_url: str, **overrides) -> dict:  # noqa: ANN003
    """The body the harness sends."""
    return {"type": "function_call", "name": "search", "server_url": server_url,
            "headers": {"Accept": "application/json", "Content-Type": "application/json",
                        "Authorization": f"Bearer {TOKEN}"},
            "arguments": json.dumps({"query": "ACME revenue"}), "item": {"id": 7, "question": "ACME?"},
            "trace_id": "trace_harness_1", "id": "fc_from_harness", "call_id": "call_abc", **overrides}


def test_the_call_reaches_the_tool_as_a_rollout_sends_it_and_its_reply_comes_back(tool_run):
    with harness_tool_server() as (tools, received):
        answer = tool_run(call(f"{tools}/search", rate_limit_hint=3))  # a field of the harness's own: not forwarded
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert json.loads(reply["output"]) == {"document": "ACME revenue 2023 was 412 million"}
    assert (reply["call_id"], reply["id"]) == ("call_abc", "fc_from_harness")
    assert reply["x_agent_rft"]["status"] == "ok" and reply["x_agent_rft"]["attempts"] == 1
    [sent] = received.calls
    assert sent["body"] == {"type": "function_call", "id": "fc_from_harness", "call_id": "call_abc", "name": "search",
                            "arguments": '{"query": "ACME revenue"}', "trace_id": "trace_harness_1",
                            "item": {"id": 7, "question": "ACME?"}}
    headers = sent["headers"]
    assert headers["authorization"] == f"Bearer {TOKEN}" and headers["accept"] == "application/json"
    assert headers["traceparent"].split("-")[1] == w3c_trace_id("trace_harness_1")
    assert headers["idempotency-key"]


def test_ids_are_made_when_the_harness_sends_none_and_arguments_may_be_an_object(tool_run):
    with harness_tool_server() as (tools, received):
        answer = tool_run(call(f"{tools}/list", name="list", arguments={}, trace_id=None, id=None, call_id=None))
    assert answer.status_code == 200, answer.text
    body = received.calls[0]["body"]
    assert body["arguments"] == "{}" and body["call_id"].startswith("call_") and body["id"].startswith("fc_")
    assert answer.json()["call_id"] == body["call_id"]


def test_a_tool_that_refuses_the_call_answers_what_the_agent_would_read(tool_run):
    with harness_tool_server() as (tools, _):
        answer = tool_run(call(f"{tools}/search", headers={"Authorization": "Bearer wrong"}))
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert "Invalid bearer token" in reply["output"] and reply["call_id"] == "call_abc"
    assert (reply["x_agent_rft"]["status"], reply["x_agent_rft"]["status_code"]) == ("client_error", 401)


@pytest.mark.parametrize("url", ["http://10.1.2.3/search", "http://169.254.169.254/latest/meta-data",
                                 "http://[::1]:9/search", "file:///etc/passwd"])
def test_a_private_or_odd_url_is_refused(tool_run, url):
    answer = tool_run(call(url))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "server_url"
    assert answer.json()["error"]["code"] == ("invalid_value" if url.startswith("file:") else "url_not_allowed")


def test_a_dead_tool_is_a_502_and_a_slow_one_a_504(tool_run):
    dead = tool_run(call(f"http://127.0.0.1:{free_port()}/search", retries=0))
    assert dead.status_code == 502 and dead.json()["error"]["code"] == "tool_unavailable", dead.text
    with harness_tool_server() as (tools, received):
        slow = tool_run(call(f"{tools}/search", arguments=json.dumps({"query": "sleep 3"}), timeout=0.5, retries=1))
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "tool_timeout", slow.text
    assert "2 attempt(s)" in slow.json()["error"]["message"] and len(received.calls) == 2


def test_bad_bodies_name_the_parameter(tool_run):
    missing = tool_run({"type": "function_call", "server_url": "http://127.0.0.1:9/x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "name"
    host = tool_run(call("http://127.0.0.1:9/x", headers={"Host": "evil"}))
    assert host.status_code == 400 and host.json()["error"]["param"] == "headers"


def test_it_needs_an_api_key(settings):
    with live_server(settings) as base:
        refused = httpx.post(f"{base}/v1/fine_tuning/alpha/tool/run", json=call("http://127.0.0.1:9/x"))
    assert refused.status_code == 401
