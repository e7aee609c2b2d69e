"""ToolClient (workers/engine/tools_client.py) against a real tool server on 127.0.0.1 that records
every request it receives: wire format, 4xx/5xx/timeout/connection handling, retries, the
output size cap, per-tool concurrency, and the SSRF guard."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse

from tests.conftest import free_port, serve_app
from workers.engine.tools_client import ToolClient, ToolClientOptions, ToolEndpoint, ToolResult

LOCAL = ["127.0.0.1"]
FAST = ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02, connect_timeout_s=2, read_timeout_s=5)
ITEM = {"reference_answer": "100", "nested": {"year": 2000, "tags": ["a", "b"]}}


class ToolServer:
    """A customer's tool server. POST /{tool} answers what the test scripted for that tool, in
    order (then `default`), and records every request: path, headers, JSON body, client port.
    It also measures how many requests of each tool were in flight at once."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.scripts: dict[str, deque[Any]] = defaultdict(deque)
        self.delay_s: dict[str, float] = {}
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.app = FastAPI()
        self.app.post("/{tool}")(self.handle)

    def script(self, tool: str, *answers: Any, delay_s: float = 0.0) -> str:
        self.scripts[tool].extend(answers)
        self.delay_s[tool] = delay_s
        return tool

    def seen(self, tool: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == f"/{tool}"]

    async def handle(self, tool: str, request: Request) -> Response:
        body = await request.body()
        self.requests.append({"path": f"/{tool}", "headers": dict(request.headers), "body": json.loads(body),
                              "port": request.client.port})
        self.in_flight[tool] += 1
        self.max_in_flight[tool] = max(self.max_in_flight[tool], self.in_flight[tool])
        try:
            await asyncio.sleep(self.delay_s.get(tool, 0.0))
        finally:
            self.in_flight[tool] -= 1
        answer = self.scripts[tool].popleft() if self.scripts[tool] else 200
        return self.answer(answer, json.loads(body))

    @staticmethod
    def answer(answer: Any, call: dict[str, Any]) -> Response:
        """200 (echo the call), another status code (with a short body), or a ready Response."""
        if isinstance(answer, Response):
            return answer
        if answer == 200:
            output = f"{call['name']}({call['arguments']}) for {call['trace_id']}"
            return JSONResponse({"type": "function_call_output", "call_id": call["call_id"], "output": output})
        return PlainTextResponse(f"scripted {answer}", status_code=answer)


serve = serve_app


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[ToolServer, int]]:
    tool_server = ToolServer()
    with serve(tool_server.app) as port:
        yield tool_server, port


@pytest.fixture
def server(running: tuple[ToolServer, int]) -> ToolServer:
    tool_server, port = running
    tool_server.requests.clear()
    tool_server.scripts.clear()
    tool_server.delay_s.clear()
    tool_server.max_in_flight.clear()
    tool_server.port = port
    return tool_server


def endpoint(server: ToolServer, name: str, **kw: Any) -> ToolEndpoint:
    return ToolEndpoint(name=name, server_url=f"http://127.0.0.1:{server.port}/{name}", **kw)


def call_once(tools: list[ToolEndpoint], name: str, *, allowlist: list[str] = LOCAL,
              options: ToolClientOptions = FAST, **call: Any) -> ToolResult:
    async def go() -> ToolResult:
        async with ToolClient(tools, allowlist=allowlist, options=options) as client:
            return await client.call(**{"trace_id": "trace_abc", "call_id": "call_1", "name": name,
                                        "arguments_json": '{"query": "revenue 2000"}', "item": ITEM, **call})

    return asyncio.run(go())


# --- wire format --------------------------------------------------------------------------------


def test_a_call_is_posted_in_the_documented_shape_with_the_tools_headers(server: ToolServer) -> None:
    tool = endpoint(server, "search", headers={"Authorization": "Bearer tool-secret", "X-Tenant": "acme"})
    result = call_once([tool], "search")

    assert result.status == "ok" and result.ok
    assert result.output == 'search({"query": "revenue 2000"}) for trace_abc'
    assert (result.status_code, result.attempts, result.error, result.truncated) == (200, 1, None, False)
    assert result.bytes > 0 and result.latency_s > 0
    (request,) = server.seen("search")
    body = request["body"]
    assert set(body) == {"type", "id", "call_id", "name", "arguments", "trace_id", "item"}
    assert body["type"] == "function_call" and body["id"].startswith("fc_")
    assert body["call_id"] == "call_1" and body["name"] == "search" and body["trace_id"] == "trace_abc"
    assert body["arguments"] == '{"query": "revenue 2000"}'  # a JSON string, not an object
    assert body["item"] == ITEM
    assert request["headers"]["authorization"] == "Bearer tool-secret"
    assert request["headers"]["x-tenant"] == "acme"
    assert request["headers"]["content-type"] == "application/json"


def test_trace_id_is_passed_through_and_each_call_keeps_its_call_id(server: ToolServer) -> None:
    tools = [endpoint(server, "search"), endpoint(server, "fetch")]

    async def rollout() -> list[ToolResult]:
        async with ToolClient(tools, allowlist=LOCAL, options=FAST) as client:
            return [await client.call(trace_id="trace_r1", call_id=f"call_{i}", name=name, arguments_json="{}", item={})
                    for i, name in enumerate(["search", "fetch", "search"])]

    results = asyncio.run(rollout())
    assert [r.call_id for r in results] == ["call_0", "call_1", "call_2"]
    bodies = [r["body"] for r in server.requests]
    assert [b["trace_id"] for b in bodies] == ["trace_r1"] * 3
    assert [(b["name"], b["call_id"]) for b in bodies] == [("search", "call_0"), ("fetch", "call_1"), ("search", "call_2")]
    assert len({b["id"] for b in bodies}) == 3


def test_a_plain_text_reply_is_the_output(server: ToolServer) -> None:
    server.script("plain", PlainTextResponse("42 reports found"))
    assert call_once([endpoint(server, "plain")], "plain").output == "42 reports found"


# --- errors and retries -------------------------------------------------------------------------


def test_a_4xx_body_is_shown_to_the_model_without_retry(server: ToolServer) -> None:
    server.script("search", PlainTextResponse("query must not be empty", status_code=422))
    result = call_once([endpoint(server, "search")], "search", arguments_json='{"query": ""}')

    assert result.status == "client_error"
    assert result.output == "query must not be empty"
    assert (result.status_code, result.attempts) == (422, 1)
    assert len(server.seen("search")) == 1


def test_413_is_shown_to_the_model_like_other_4xx(server: ToolServer) -> None:
    server.script("upload", PlainTextResponse("payload too large: max 10 kB", status_code=413))
    result = call_once([endpoint(server, "upload")], "upload")
    assert (result.status, result.output, result.status_code) == ("client_error", "payload too large: max 10 kB", 413)


def test_5xx_is_retried_until_it_succeeds(server: ToolServer) -> None:
    server.script("search", 503, 503, 200)
    result = call_once([endpoint(server, "search")], "search")

    assert result.status == "ok" and result.attempts == 3
    assert len(server.seen("search")) == 3
    assert len({r["body"]["id"] for r in server.seen("search")}) == 1  # the same call, retried


def test_a_tool_failing_every_attempt_fails_the_call_without_raising(server: ToolServer) -> None:
    server.script("search", *[500] * 10)
    result = call_once([endpoint(server, "search")], "search")

    assert result.status == "failed"
    assert result.attempts == 4 and len(server.seen("search")) == 4  # 1 + 3 retries
    assert result.status_code == 500 and "HTTP 500: scripted 500" in result.error
    assert "failed after 4 attempt(s)" in result.output


def test_a_closed_port_fails_after_retries(server: ToolServer) -> None:
    closed = ToolEndpoint(name="search", server_url=f"http://127.0.0.1:{free_port()}/search")
    result = call_once([closed], "search")
    assert (result.status, result.attempts, result.status_code) == ("failed", 4, None)
    assert "ConnectError" in result.error



def test_408_and_429_are_retried_like_5xx_and_each_retry_is_logged(server: ToolServer, caplog) -> None:  # noqa: ANN001
    server.script("search", 429, 408, 200)
    with caplog.at_level(logging.INFO, logger="workers.engine.tools_client"):
        result = call_once([endpoint(server, "search")], "search")

    assert (result.status, result.attempts, result.status_code) == ("ok", 3, 200)
    assert len(server.seen("search")) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "tool search: attempt 1 failed (HTTP 429: scripted 429); retrying",
        "tool search: attempt 2 failed (HTTP 408: scripted 408); retrying",
    ]


def test_retries_0_makes_a_single_attempt(server: ToolServer) -> None:
    server.script("search", 503, 200)
    result = call_once([endpoint(server, "search")], "search",
                       options=ToolClientOptions(retries=0, backoff_base_s=0.01))
    assert (result.status, result.attempts, result.status_code) == ("failed", 1, 503)
    assert "failed after 1 attempt(s): HTTP 503: scripted 503" in result.output
    assert len(server.seen("search")) == 1


def test_concurrent_calls_count_their_own_attempts(server: ToolServer) -> None:
    server.script("flaky", 500, 500, 200)
    server.script("steady", 200)

    async def go() -> list[ToolResult]:
        tools = [endpoint(server, "flaky"), endpoint(server, "steady")]
        async with ToolClient(tools, allowlist=LOCAL, options=FAST) as client:
            return await asyncio.gather(*[
                client.call(trace_id="t", call_id=f"call_{name}", name=name, arguments_json="{}", item={})
                for name in ("flaky", "steady")])

    flaky, steady = asyncio.run(go())
    assert (flaky.status, flaky.attempts) == ("ok", 3)
    assert (steady.status, steady.attempts) == ("ok", 1)

def test_a_slow_tool_times_out_and_is_retried(server: ToolServer) -> None:
    server.script("slow", delay_s=1.0)
    options = ToolClientOptions(backoff_base_s=0.01, read_timeout_s=0.1)
    started = time.monotonic()
    result = call_once([endpoint(server, "slow")], "slow", options=options)

    assert (result.status, result.attempts) == ("failed", 4)
    assert "timeout" in result.error
    assert len(server.seen("slow")) == 4
    assert time.monotonic() - started < 1.5


def test_a_server_trickling_its_reply_is_cut_off_by_the_attempt_timeout(server: ToolServer) -> None:
    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(100):
            await asyncio.sleep(0.02)  # always within the read timeout, never finished
            yield b"."

    server.script("trickle", StreamingResponse(trickle()))
    options = ToolClientOptions(retries=0, read_timeout_s=1, attempt_timeout_s=0.3)
    started = time.monotonic()
    result = call_once([endpoint(server, "trickle")], "trickle", options=options)
    assert (result.status, result.attempts) == ("failed", 1)
    assert "timeout" in result.error
    assert time.monotonic() - started < 1


def test_a_tools_own_timeout_and_retries_replace_the_defaults(server: ToolServer) -> None:
    """`timeout` and `retries` on method.reinforcement.tools[]: a trickling tool is cut at its own
    timeout (the default would wait 120 s an attempt, 4 attempts), a slow-to-answer tool given a
    longer timeout may stay silent past the default read timeout."""
    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(200):
            await asyncio.sleep(0.02)
            yield b"."

    server.script("trickler", StreamingResponse(trickle()), StreamingResponse(trickle()))
    server.script("thinker", 200, delay_s=0.6)
    options = ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02, read_timeout_s=0.3)
    tools = [{"name": "trickler", "server_url": f"http://127.0.0.1:{server.port}/trickler", "timeout": 0.3,
              "retries": 1},
             {"name": "thinker", "server_url": f"http://127.0.0.1:{server.port}/thinker", "timeout": 5}]
    started = time.monotonic()
    trickled = call_once(tools, "trickler", options=options)
    assert (trickled.status, trickled.attempts) == ("failed", 2) and "attempt 0.3 s" in trickled.error
    assert time.monotonic() - started < 2
    assert call_once(tools, "thinker", options=options).status == "ok"  # 0.6 s of silence, under its 5 s


def test_a_redirect_is_not_followed(server: ToolServer) -> None:
    server.script("moved", RedirectResponse(f"http://127.0.0.1:{server.port}/search", status_code=302))
    result = call_once([endpoint(server, "moved"), endpoint(server, "search")], "moved")
    assert (result.status, result.status_code, result.attempts) == ("failed", 302, 1)
    assert "redirects are not followed" in result.error
    assert server.seen("search") == []


def test_an_unknown_tool_is_answered_with_the_available_ones(server: ToolServer) -> None:
    result = call_once([endpoint(server, "search"), endpoint(server, "fetch")], "browse")
    assert result.status == "unknown_tool"
    assert "unknown tool 'browse'" in result.output and "fetch, search" in result.output
    assert server.requests == []


def test_a_tool_url_refused_by_the_ssrf_guard_is_blocked_and_never_called(server: ToolServer) -> None:
    result = call_once([endpoint(server, "search")], "search", allowlist=[])
    assert (result.status, result.attempts) == ("blocked", 1)
    assert "non-public address" in result.output and "AGENT_RFT_OUTBOUND_ALLOWLIST" in result.error
    assert server.requests == []


# --- output size cap ------------------------------------------------------------------------------


def test_an_oversized_output_reaches_the_model_truncated_with_a_notice(server: ToolServer) -> None:
    huge = "x" * (3 * 1024 * 1024)
    server.script("dump", JSONResponse({"type": "function_call_output", "call_id": "call_1", "output": huge}))
    result = call_once([endpoint(server, "dump")], "dump")

    assert result.status == "ok" and result.truncated
    assert result.bytes > 3 * 1024 * 1024
    notice = "[output truncated: the tool returned more than 1048576 bytes; showing the first 1048576]"
    assert result.output.startswith(notice)
    assert len(result.output) == len(notice) + 1 + 1048576


def test_the_size_cap_is_configurable_and_applies_to_error_bodies(server: ToolServer) -> None:
    server.script("search", PlainTextResponse("e" * 500, status_code=400))
    options = ToolClientOptions(max_output_bytes=100, backoff_base_s=0.01)
    result = call_once([endpoint(server, "search")], "search", options=options)
    assert result.status == "client_error" and result.truncated
    assert result.output.endswith("\n" + "e" * 100) and "more than 100 bytes" in result.output


# --- concurrency ----------------------------------------------------------------------------------


def test_the_per_tool_concurrency_limit_is_respected(server: ToolServer) -> None:
    server.script("limited", delay_s=0.05)
    # Another tool with the default limit gives the client a connection pool larger than 2.
    tools = [endpoint(server, "limited", max_concurrency=2), endpoint(server, "search")]

    async def ten_calls() -> list[ToolResult]:
        async with ToolClient(tools, allowlist=LOCAL, options=FAST) as client:
            calls = [client.call(trace_id=f"trace_{i}", call_id="call_1", name="limited", arguments_json="{}", item={})
                     for i in range(10)]
            return await asyncio.gather(*calls)

    results = asyncio.run(ten_calls())
    assert all(r.ok for r in results)
    assert server.max_in_flight["limited"] == 2


def test_calls_to_different_tools_run_concurrently(server: ToolServer) -> None:
    for name in ("a", "b", "c"):
        server.script(name, delay_s=0.3)
    tools = [endpoint(server, name) for name in ("a", "b", "c")]

    async def one_each() -> float:
        async with ToolClient(tools, allowlist=LOCAL, options=FAST) as client:
            started = time.monotonic()
            await asyncio.gather(*[client.call(trace_id="trace_1", call_id=f"call_{n}", name=n, arguments_json="{}", item={})
                                   for n in ("a", "b", "c")])
            return time.monotonic() - started

    assert asyncio.run(one_each()) < 0.6  # ~max (0.3 s), not the sum (0.9 s)


def test_a_rate_limit_spaces_requests(server: ToolServer) -> None:
    tool = endpoint(server, "search", rate_limit=20)  # one request every 50 ms

    async def five_calls() -> float:
        async with ToolClient([tool], allowlist=LOCAL, options=FAST) as client:
            started = time.monotonic()
            await asyncio.gather(*[client.call(trace_id="t", call_id=f"c{i}", name="search", arguments_json="{}", item={})
                                   for i in range(5)])
            return time.monotonic() - started

    assert asyncio.run(five_calls()) >= 0.18


def test_sequential_calls_reuse_one_connection(server: ToolServer) -> None:
    tool = endpoint(server, "search")

    async def many() -> None:
        async with ToolClient([tool], allowlist=LOCAL, options=FAST) as client:
            for i in range(8):
                await client.call(trace_id="trace_1", call_id=f"call_{i}", name="search", arguments_json="{}", item={})

    asyncio.run(many())
    assert len({r["port"] for r in server.seen("search")}) == 1


def test_tools_can_be_configured_from_the_job_spec() -> None:
    from app.jobs.schemas import ToolEndpoint as JobTool

    spec = JobTool(name="search", server_url="http://127.0.0.1:1/s", headers={"Authorization": "Bearer x"})
    assert ToolEndpoint.from_spec(spec) == ToolEndpoint(name="search", server_url="http://127.0.0.1:1/s",
                                                        headers={"Authorization": "Bearer x"})
    assert ToolEndpoint.from_spec({"name": "fetch", "server_url": "http://h/f"}).name == "fetch"
    with pytest.raises(ValueError, match="configured twice"):
        ToolClient([spec, spec])
