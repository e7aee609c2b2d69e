"""What a tool server receives beyond the body, and the calls it is spared, against a real tool
server on 127.0.0.1 (tests/rl/test_tools_client.py's ToolServer): the Idempotency-Key of a call
and its retries, the W3C traceparent, the tool-result cache of read-only tools, and the variance
diagnostic's skip / dry_run of tools that are not read-only."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from agent_rft.tracing import idempotency_key, w3c_trace_id
from tests.rl.test_tools_client import FAST, LOCAL, ToolServer, endpoint, running, server  # noqa: F401 - fixtures
from workers.engine.rollout import RolloutRecord, ToolCallRecord
from workers.engine.summary import summarize
from workers.engine.tools_client import ToolClient, ToolEndpoint, ToolResult

TRACE = "trace_" + "0123456789abcdef" * 2
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-01$")


def calls(tools: list[ToolEndpoint], *requests: dict[str, Any], non_read_only: str = "call",
          concurrent: bool = False) -> tuple[list[ToolResult], dict[str, Any]]:
    """Run the calls on one client (one job), in order or all at once; also its cache stats."""
    async def go() -> tuple[list[ToolResult], dict[str, Any]]:
        async with ToolClient(tools, allowlist=LOCAL, options=FAST, non_read_only=non_read_only) as client:
            made = [client.call(**{"trace_id": TRACE, "call_id": f"call_{i}", "arguments_json": '{"q": "acme"}',
                                   "item": {"row": 1}, **request}) for i, request in enumerate(requests)]
            results = list(await asyncio.gather(*made)) if concurrent else [await c for c in made]
            return results, client.cache_stats()

    return asyncio.run(go())


# --- Idempotency-Key -------------------------------------------------------------------------------


def test_every_attempt_of_one_call_carries_the_same_idempotency_key_and_calls_differ(server: ToolServer) -> None:
    server.script("charge", 500, 500, 200)
    (first, second), _ = calls([endpoint(server, "charge")], {"name": "charge", "call_id": "call_a"},
                               {"name": "charge", "call_id": "call_b"})
    assert first.ok and first.attempts == 3 and second.ok and second.attempts == 1
    keys = [r["headers"]["idempotency-key"] for r in server.seen("charge")]
    assert len(keys) == 4
    assert keys[0] == keys[1] == keys[2] == idempotency_key(TRACE, "call_a")
    assert keys[3] == idempotency_key(TRACE, "call_b") != keys[0]
    assert re.fullmatch(r"[0-9a-f]{64}", keys[0])
    # The retries repeat the body too: same id, call_id, trace_id.
    bodies = [r["body"] for r in server.seen("charge")[:3]]
    assert bodies[0] == bodies[1] == bodies[2]


def test_the_same_call_id_in_another_rollout_has_another_key(server: ToolServer) -> None:
    assert idempotency_key("trace_1", "call_1") != idempotency_key("trace_2", "call_1")


# --- traceparent -----------------------------------------------------------------------------------


def test_traceparent_is_well_formed_and_names_the_rollouts_trace(server: ToolServer) -> None:
    server.script("search", 503, 200)
    calls([endpoint(server, "search")], {"name": "search"}, {"name": "search", "trace_id": "trace_other"})
    requests = server.seen("search")
    headers = [r["headers"]["traceparent"] for r in requests]
    assert all(TRACEPARENT.match(h) for h in headers), headers
    for request, header in zip(requests, headers):
        assert header.split("-")[1] == w3c_trace_id(request["body"]["trace_id"])
    assert headers[0].split("-")[1] == "0123456789abcdef" * 2  # the hex of trace_<32 hex>, as it is
    assert headers[0].split("-")[2] != headers[1].split("-")[2]  # a new span per attempt
    assert headers[2].split("-")[1] != headers[0].split("-")[1]  # another rollout, another trace


def test_any_trace_id_maps_to_a_valid_w3c_trace_id() -> None:
    for trace_id in ("trace_abc", "x", "trace_" + "0" * 32, "trace_" + "AB" * 16):
        hex_id = w3c_trace_id(trace_id)
        assert re.fullmatch(r"[0-9a-f]{32}", hex_id) and hex_id != "0" * 32
        assert w3c_trace_id(trace_id) == hex_id  # stable


# --- the tool-result cache -------------------------------------------------------------------------


def cached(server: ToolServer, name: str, **kw: Any) -> ToolEndpoint:
    return endpoint(server, name, read_only=True, cache_ttl_s=kw.pop("ttl", float("inf")), **kw)


def test_identical_calls_of_a_cached_tool_reach_the_endpoint_once(server: ToolServer) -> None:
    results, stats = calls([cached(server, "lookup")], *[{"name": "lookup"}] * 10)
    assert len(server.seen("lookup")) == 1
    assert stats["lookup"] == {"lookups": 10, "hits": 9, "calls_saved": 9, "hit_rate": 0.9}
    assert [r.cached for r in results] == [False] + [True] * 9
    assert all(r.ok and r.output == results[0].output for r in results)
    assert [r.call_id for r in results] == [f"call_{i}" for i in range(10)]  # each answer under its own call id


def test_concurrent_identical_calls_wait_for_the_first_instead_of_calling_again(server: ToolServer) -> None:
    server.script("lookup", 200, delay_s=0.2)
    results, stats = calls([cached(server, "lookup")], *[{"name": "lookup"}] * 10, concurrent=True)
    assert len(server.seen("lookup")) == 10 - stats["lookup"]["hits"] == 1
    assert sum(r.cached for r in results) == 9


def test_the_key_is_the_canonical_arguments_and_the_item(server: ToolServer) -> None:
    requests = [{"name": "lookup", "arguments_json": '{"q": "acme", "year": 2023}'},
                {"name": "lookup", "arguments_json": '{"year":2023,"q":"acme"}'},  # same, reordered
                {"name": "lookup", "arguments_json": '{"q": "acme", "year": 2022}'},  # other arguments
                {"name": "lookup", "arguments_json": '{"q": "acme", "year": 2023}', "item": {"row": 2}}]  # other item
    _, stats = calls([cached(server, "lookup")], *requests)
    assert (len(server.seen("lookup")), stats["lookup"]["hits"]) == (3, 1)

    server.requests.clear()
    _, stats = calls([cached(server, "lookup", cache_per_item=False)], *requests)
    assert (len(server.seen("lookup")), stats["lookup"]["hits"]) == (2, 2)


def test_tools_not_opted_in_are_never_cached(server: ToolServer) -> None:
    tools = [endpoint(server, "plain"), endpoint(server, "reader", read_only=True),
             endpoint(server, "stateful", cache_ttl_s=60.0)]  # cache without read_only: still not cached
    results, stats = calls(tools, *[{"name": name} for name in ("plain", "reader", "stateful") for _ in range(3)])
    assert stats == {}
    assert not any(r.cached for r in results)
    assert [len(server.seen(name)) for name in ("plain", "reader", "stateful")] == [3, 3, 3]


def test_only_successful_results_are_cached(server: ToolServer) -> None:
    server.script("lookup", 404, 200)
    results, stats = calls([cached(server, "lookup")], *[{"name": "lookup"}] * 3)
    assert [r.status for r in results] == ["client_error", "ok", "ok"]
    assert [r.cached for r in results] == [False, False, True]
    assert (len(server.seen("lookup")), stats["lookup"]["hits"]) == (2, 1)


def test_a_ttl_expires_entries(server: ToolServer) -> None:
    async def go() -> int:
        async with ToolClient([cached(server, "lookup", ttl=0.2)], allowlist=LOCAL, options=FAST) as client:
            for call_id in ("call_1", "call_2"):
                await client.call(trace_id=TRACE, call_id=call_id, name="lookup", arguments_json="{}", item={})
            time.sleep(0.3)
            await client.call(trace_id=TRACE, call_id="call_3", name="lookup", arguments_json="{}", item={})
            return client.cache_stats()["lookup"]["hits"]

    assert asyncio.run(go()) == 1
    assert len(server.seen("lookup")) == 2


def test_the_jobs_tool_entry_declares_read_only_and_cache() -> None:
    from pydantic import ValidationError

    from app.jobs.schemas import ToolEndpoint as JobTool

    url = "https://tools.example.com/t"
    forever = ToolEndpoint.from_spec(JobTool(name="a", server_url=url, read_only=True, cache=True))
    ttl = ToolEndpoint.from_spec(JobTool(name="b", server_url=url, read_only=True, cache=30, cache_per_item=False))
    off = ToolEndpoint.from_spec(JobTool(name="c", server_url=url))
    assert (forever.read_only, forever.cache_ttl_s, forever.cache_per_item) == (True, float("inf"), True)
    assert (ttl.cache_ttl_s, ttl.cache_per_item) == (30.0, False)
    assert (off.read_only, off.cache_ttl_s) == (False, None)
    with pytest.raises(ValidationError, match="read_only"):
        JobTool(name="d", server_url=url, cache=True)


def test_cache_hits_are_step_metrics() -> None:
    def call(name: str, cached: bool) -> ToolCallRecord:
        return ToolCallRecord(call_id="c", name=name, arguments="{}", status="ok", status_code=200, latency_s=0.0,
                              bytes=1, error=None, cached=cached)

    record = RolloutRecord(trace_id="t", sample_index=0, messages=[],
                           tool_calls=[call("search", False), call("search", True), call("search", True),
                                       call("cat", False)])
    summary = summarize([record])
    assert summary["tool_cache_hits_by_tool"] == {"cat": 0, "search": 2}
    assert summary["tool_cache_hit_rate_by_tool"] == {"cat": 0.0, "search": pytest.approx(2 / 3)}
    assert summary["tool_calls_saved"] == 2


# --- the variance diagnostic: tools that are not read-only -------------------------------------------


def test_skip_answers_side_effecting_tools_with_an_error_and_calls_read_only_ones(server: ToolServer) -> None:
    tools = [endpoint(server, "order"), endpoint(server, "search", read_only=True)]
    (order, search), _ = calls(tools, {"name": "order"}, {"name": "search"}, non_read_only="skip")
    assert order.status == "skipped" and "skipped" in order.output and "not read-only" in order.output
    assert search.ok
    assert (len(server.seen("order")), len(server.seen("search"))) == (0, 1)


def test_dry_run_flags_side_effecting_calls_in_the_body(server: ToolServer) -> None:
    tools = [endpoint(server, "order"), endpoint(server, "search", read_only=True)]
    calls(tools, {"name": "order"}, {"name": "search"}, non_read_only="dry_run")
    (order,), (search,) = server.seen("order"), server.seen("search")
    assert order["body"]["dry_run"] is True
    assert "dry_run" not in search["body"]

    server.requests.clear()
    calls(tools, {"name": "order"})  # the default (training): no flag
    assert "dry_run" not in server.seen("order")[0]["body"]
