"""Input limits (docs/security.md, "Input limits"): a NUL character in
any string that would reach PostgreSQL (the path, the query, a form field, a JSON string) is a
400 naming where it was, never psycopg's DataError as a 500; JSON nested deeper than
MAX_JSON_DEPTH is a 400 for a request body and a line-numbered error for a JSONL row."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from app.core.input_limits import MAX_JSON_DEPTH
from tests.conftest import jsonl, job_body, live_server, question_rows, wait_for
from tests.dashboard.helpers import login

DIAGNOSTICS = "/v1/fine_tuning/alpha/diagnostics"


@pytest.fixture
def ids(api) -> dict[str, str]:  # noqa: ANN001
    """One of every object a list or a path names: a file, a job (cancelled, so that its endpoint
    has a delivery), a diagnostic, a webhook endpoint and that delivery."""
    file_id = api.upload_ok(question_rows(3))
    endpoint = api.post("/v1/webhook_endpoints", json={"name": "e", "url": "http://127.0.0.1:9/hook",
                                                       "event_types": ["fine_tuning.job.cancelled"]})
    job = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    diagnostic = api.post(DIAGNOSTICS, json=job_body(file_id))
    assert endpoint.status_code == job.status_code == diagnostic.status_code == 200, (endpoint.text, job.text)
    job_id, endpoint_id = job.json()["id"], endpoint.json()["id"]
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    deliveries = wait_for(lambda: api.get(f"/v1/webhook_endpoints/{endpoint_id}/deliveries").json()["data"])
    return {"file": file_id, "job": job_id, "diagnostic": diagnostic.json()["id"], "endpoint": endpoint_id,
            "delivery": deliveries[0]["id"]}


def assert_refused(response: httpx.Response, param: str, code: str = "invalid_value") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), error


LISTS = [
    "/v1/files",
    "/v1/fine_tuning/jobs",
    "/v1/fine_tuning/jobs/{job}/events",
    "/v1/fine_tuning/jobs/{job}/checkpoints",
    "/v1/fine_tuning/jobs/{job}/rollouts",
    DIAGNOSTICS,
    DIAGNOSTICS + "/{diagnostic}/rollouts",
    "/v1/webhook_endpoints",
    "/v1/webhook_endpoints/{endpoint}/deliveries",
    "/v1/webhook_endpoints/{endpoint}/deliveries/{delivery}/attempts",
]


@pytest.mark.parametrize("path", LISTS)
def test_a_nul_in_after_is_refused_on_every_list(api, ids, path):  # noqa: ANN001
    url = path.format(**ids)
    assert_refused(api.get(url, params={"after": "file-\x00"}), "after")
    assert api.get(url).status_code == 200  # the list itself works


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/files/file-\x00", "file_id"),
    ("/v1/files/file-\x00/content", "file_id"),
    ("/v1/fine_tuning/jobs/ftjob-\x00", "fine_tuning_job_id"),
    ("/v1/fine_tuning/jobs/ftjob-\x00/events", "fine_tuning_job_id"),
    (DIAGNOSTICS + "/diag-\x00", "diagnostic_id"),
    ("/v1/webhook_endpoints/we_\x00", "webhook_endpoint_id"),
    ("/v1/webhook_endpoints/{endpoint}/deliveries/whd_\x00", "delivery_id"),
    ("/v1/models/ft:\x00", "model"),
])
def test_a_nul_in_an_id_in_the_path_is_refused_by_name(api, ids, path, param):  # noqa: ANN001
    assert_refused(api.get(path.replace("\x00", "%00").format(**ids)), param)


def test_a_nul_in_the_metadata_filter_is_refused(api, ids):  # noqa: ANN001
    assert_refused(api.get("/v1/fine_tuning/jobs", params={"metadata[k]": "\x00"}), "metadata[k]")
    assert_refused(api.get("/v1/fine_tuning/jobs?metadata[%00]=v"), "metadata[\\u0000]")
    assert api.get("/v1/fine_tuning/jobs", params={"metadata[k]": "v"}).status_code == 200


def test_a_nul_in_a_json_body_is_refused_by_field_path(api, ids):  # noqa: ANN001
    file_id = ids["file"]
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/fine_tuning/jobs", job_body(file_id, suffix="a\x00b"), "suffix"),
        ("/v1/fine_tuning/jobs", job_body(file_id, model="Smol\x00"), "model"),
        ("/v1/fine_tuning/jobs", job_body(file_id, metadata={"k": "\x00"}), "metadata.k"),
        ("/v1/fine_tuning/jobs", job_body(file_id, metadata={"k\x00": "v"}), "metadata.k\\u0000"),
        ("/v1/fine_tuning/jobs", job_body(file_id, reinforcement={"grader": {
            "type": "string_check", "name": "exact\x00", "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}", "operation": "eq"}}), "method.reinforcement.grader.name"),
        ("/v1/fine_tuning/jobs", job_body(file_id, reinforcement={"tools": [
            {"name": "search", "server_url": "http://127.0.0.1:8765/\x00"}]}), "method.reinforcement.tools[0].server_url"),
        (DIAGNOSTICS, job_body(file_id, model="Smol\x00"), "model"),
        ("/v1/webhook_endpoints", {"name": "n\x00", "url": "http://127.0.0.1:9/h",
                                   "event_types": ["fine_tuning.job.failed"]}, "name"),
        (f"/v1/webhook_endpoints/{ids['endpoint']}", {"name": "\x00"}, "name"),
    ]
    for path, body, param in cases:
        assert_refused(api.post(path, json=body), param)
    # An escaped backslash followed by "u0000" is six ordinary characters, not a NUL.
    fine = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, metadata={"k": "\\u0000"}))
    assert fine.status_code == 200 and fine.json()["metadata"] == {"k": "\\u0000"}, fine.text


def test_a_chat_conversation_may_hold_a_nul_but_not_its_model(api):  # noqa: ANN001
    # The conversation goes to the inference server only (none runs here: 503), never to the database.
    conversation = [{"role": "user", "content": "what does the tool say?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "binary \x00 output"}]
    passed = api.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": conversation})
    assert passed.json()["error"]["code"] == "inference_unavailable", passed.text
    assert_refused(api.post("/v1/chat/completions", json={"model": "Smol\x00", "messages": conversation}), "model")


def test_the_worker_api_checks_paths_but_stores_bodies(client, settings):  # noqa: ANN001
    # Its pushes keep a NUL as U+FFFD (tests/test_internal.py); an id in its path is checked like any other.
    headers = {"Authorization": f"Bearer {settings.worker_token.get_secret_value()}"}
    response = client.post("/internal/v1/jobs/ftjob-%00/claim", json={"worker_id": "w"}, headers=headers)
    assert_refused(response, "job_id")


def test_a_nul_in_a_json_body_without_a_content_type_is_refused(api, ids):  # noqa: ANN001
    body = json.dumps({"name": "n\x00", "url": "http://127.0.0.1:9/h", "event_types": ["fine_tuning.job.failed"]})
    response = api.post("/v1/webhook_endpoints", content=body.encode(), headers={"Content-Type": ""})
    assert_refused(response, "name")


def test_the_dashboard_refuses_a_nul_in_its_pages_filters_and_forms(client, api, ids, project):  # noqa: ANN001
    login(client, project["key"])
    job = ids["job"]
    for url, param in [
        ("/dashboard/jobs?status=%00", "status"),
        ("/dashboard/jobs/ftjob-%00", "job_id"),
        ("/dashboard/jobs/ftjob-%00/data", "job_id"),
        (f"/dashboard/jobs/{job}/rollouts?after=%00", "after"),
        (f"/dashboard/jobs/{job}/rollouts?tool=%00", "tool"),
        (f"/dashboard/jobs/{job}/rollouts/trace-%00", "trace_id"),
        ("/dashboard/diagnostics/diag-%00", "diagnostic_id"),
    ]:
        assert_refused(client.get(url), param)
    # A form body (x-www-form-urlencoded), as the login page posts it.
    assert_refused(client.post("/dashboard/login", data={"api_key": "sk-\x00", "csrf_token": "x"}), "api_key")
    assert client.get(f"/dashboard/jobs/{job}/rollouts").status_code == 200


def test_the_connection_stays_open_after_a_refusal(settings, project):  # noqa: ANN001
    headers = {"Authorization": f"Bearer {project['key']}"}
    with live_server(settings) as base, httpx.Client(base_url=base, headers=headers) as http:
        ports = []
        for url in ("/v1/files?after=%00", "/v1/files/file-%00", "/v1/files"):
            response = http.get(url)
            assert response.status_code == (200 if url == "/v1/files" else 400), response.text
            assert response.headers.get("connection") != "close"
            ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])
        assert len(set(ports)) == 1, ports  # one keep-alive connection served all three


def test_a_nul_in_an_uploaded_file_name_is_refused(api):  # noqa: ANN001
    # Built by hand: httpx would percent-escape the NUL in the part's header.
    boundary = "b0undary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a\x00.jsonl"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + jsonl(question_rows(1)) \
        + f"\r\n--{boundary}--\r\n".encode()
    response = api.post("/v1/files", content=body,
                        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert_refused(response, "file")
    assert api.get("/v1/files").json()["data"] == []


def nested(depth: int) -> str:
    """A JSON value `depth` arrays deep."""
    return "[" * depth + "]" * depth


def run_job(api, content: bytes) -> dict[str, Any]:  # noqa: ANN001
    file_id = api.upload_ok(content)
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
    return wait_for(lambda: (j := api.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] != "validating_files" and j)


def test_jsonl_rows_nested_too_deep_or_with_a_nul_fail_with_their_line_numbers(api):  # noqa: ANN001
    good = question_rows(1)[0]
    deep = {**good, "reference_answer": json.loads(nested(MAX_JSON_DEPTH))}  # one level more than allowed
    lines = [
        json.dumps(good),                                               # 1 ok
        '{"messages": ' + nested(10_000) + "}",                         # 2: deeper than json.loads recurses
        json.dumps(deep),                                               # 3
        json.dumps({**good, "reference_answer": "4\x002"}),             # 4: an escaped NUL
        json.dumps(good).replace('"Answer', '"\x00Answer'),             # 5: a raw NUL byte: not JSON
        json.dumps(good),                                               # 6 ok
    ]
    job = run_job(api, ("\n".join(lines) + "\n").encode())
    assert job["status"] == "failed", job
    error = job["error"]
    assert error["code"] == "too_deep" and error["param"] == "training_file", error
    message = error["message"]
    assert "has 4 invalid lines" in message, message
    assert f"line 2: the row is nested more than {MAX_JSON_DEPTH} levels deep" in message, message
    assert f"line 3: the row is nested more than {MAX_JSON_DEPTH} levels deep" in message, message
    assert "line 4: reference_answer contains a NUL character" in message, message
    assert "line 5: not valid JSON" in message, message


def test_jsonl_rows_at_the_depth_limit_are_valid(api):  # noqa: ANN001
    rows = [{**row, "reference_answer": json.loads(nested(MAX_JSON_DEPTH - 1))} for row in question_rows(3)]
    job = run_job(api, jsonl(rows))
    assert job["status"] == "queued", job


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000, 200_000])
def test_a_request_body_nested_too_deep_is_refused(api, ids, depth):  # noqa: ANN001
    body = '{"metadata": {"k": ' + nested(depth - 2) + "}}"
    response = api.post("/v1/fine_tuning/jobs", content=body, headers={"Content-Type": "application/json"})
    assert_refused(response, "body", code="too_deep")
    assert str(MAX_JSON_DEPTH) in response.json()["error"]["message"]


def test_a_request_body_at_the_depth_limit_reaches_the_route(api, ids):  # noqa: ANN001
    body = {"name": "e", "url": "http://127.0.0.1:9/h", "event_types": ["fine_tuning.job.failed"]}
    body["x"] = json.loads(nested(MAX_JSON_DEPTH - 1))
    response = api.post("/v1/webhook_endpoints", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "x"  # pydantic's extra="forbid"


# --- unpaired surrogates: a "\ud800" escape is valid JSON but not Unicode --------------------------

LONE = "\ud800"


def post_escaped(api, path: str, body: dict[str, Any]) -> httpx.Response:  # noqa: ANN001
    """POST `body` as the JSON an SDK sends for it: json.dumps escapes a lone surrogate as \\ud800 (a
    client cannot send it as UTF-8, which has no encoding for it)."""
    return api.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def test_an_unpaired_surrogate_in_any_json_field_is_refused_by_field_path(api, ids):  # noqa: ANN001
    file_id = ids["file"]
    tool_call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "' + LONE + '"}'}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/fine_tuning/jobs", job_body(file_id, metadata={"k": LONE}), "metadata.k"),
        ("/v1/fine_tuning/jobs", job_body(file_id, metadata={LONE: "v"}), "metadata.\\ud800"),
        ("/v1/fine_tuning/jobs", job_body(file_id, suffix="a" + LONE), "suffix"),
        ("/v1/fine_tuning/jobs", job_body(file_id, reinforcement={"grader": {
            "type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
            "reference": "x" + LONE, "operation": "eq"}}), "method.reinforcement.grader.reference"),
        ("/v1/fine_tuning/jobs", job_body(file_id, reinforcement={"tools": [
            {"name": "search", "server_url": "http://127.0.0.1:8765/", "headers": {"X-Key": LONE}}]}),
         "method.reinforcement.tools[0].headers.X-Key"),
        (DIAGNOSTICS, job_body(file_id, metadata={"k": LONE}), "metadata.k"),
        ("/v1/webhook_endpoints", {"name": LONE, "url": "http://127.0.0.1:9/h",
                                   "event_types": ["fine_tuning.job.failed"]}, "name"),
        (f"/v1/webhook_endpoints/{ids['endpoint']}", {"name": LONE}, "name"),
        ("/v1/fine_tuning/checkpoints/ft:x:p::j:ckpt-step-1/permissions", {"project_ids": [LONE]}, "project_ids[0]"),
        ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", "messages": [
            {"role": "user", "content": LONE}]}, "messages[0].content"),
        ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [tool_call]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ("/v1/fine_tuning/alpha/graders/run", {"grader": {"type": "string_check", "name": "g", "input": "a",
                                                           "reference": "a", "operation": "eq"},
                                               "model_sample": "x" + LONE}, "model_sample"),
    ]
    for path, body, param in cases:
        refused = post_escaped(api, path, body)
        assert_refused(refused, param)
        assert "unpaired surrogate" in refused.json()["error"]["message"]
    # A surrogate pair is one character outside the Basic Multilingual Plane: accepted and stored as it came.
    fine = post_escaped(api, "/v1/fine_tuning/jobs", job_body(file_id, metadata={"k": "\U0001F600"}))
    assert fine.status_code == 200 and fine.json()["metadata"] == {"k": "\U0001F600"}, fine.text


def test_jsonl_rows_with_an_unpaired_surrogate_fail_with_their_line_numbers(api):  # noqa: ANN001
    good = question_rows(1)[0]
    called = {**good, "messages": [*good["messages"], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "' + LONE + '"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "nothing"}, {"role": "user", "content": "and?"}]}
    lines = [json.dumps(good),
             json.dumps({**good, "messages": [{"role": "user", "content": "rev" + LONE}]}),  # 2
             json.dumps(called),                                                           # 3
             json.dumps(good)]
    job = run_job(api, ("\n".join(lines) + "\n").encode())
    assert job["status"] == "failed", job
    error = job["error"]
    assert error["code"] == "invalid_value" and error["param"] == "training_file", error
    assert "has 2 invalid lines" in error["message"], error
    assert "line 2: messages[0].content contains an unpaired surrogate" in error["message"], error
    assert "line 3: messages[2].tool_calls[0].function.arguments contains an unpaired surrogate" in error["message"]
