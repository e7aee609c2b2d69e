"""Backpressure, not failure: a tool server on 127.0.0.1 that answers 429/503 with
Retry-After is waited out without spending retries, and the tool's concurrency adapts (AIMD),
as the server itself observes it. No mocks of the client: real HTTP, real waits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from email.utils import formatdate
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from agent_rft.concurrency import AdaptiveLimit
from agent_rft.retry import async_retrying, retry_after_s, throttle_wait_s
from tests.conftest import serve_app
from workers.engine.tools_client import ToolClient, ToolClientOptions, ToolEndpoint, ToolResult

LOCAL = ["127.0.0.1"]
FAST = ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02, connect_timeout_s=2, read_timeout_s=5)


class BusyTool:
    """A tool server that throttles. `throttle_first` requests are answered `status` with
    `retry_after` (None: no header); while `busy_until` (seconds since the first request) has not
    passed, a request arriving with `busy_above` or more already in flight is answered 429 with
    `Retry-After: 0`. Every request takes `delay_s`, throttled ones too (a busy server is slow to
    say so), and each arrival records (seconds since the first request, requests in flight)."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.app.post("/tool")(self.handle)
        self.reset()

    def reset(self, *, throttle_first: int = 0, retry_after: str | None = "1", status: int = 429,
              busy_above: int | None = None, busy_until: float = 0.0, delay_s: float = 0.0) -> None:
        self.throttle_first, self.retry_after, self.status = throttle_first, retry_after, status
        self.busy_above, self.busy_until, self.delay_s = busy_above, busy_until, delay_s
        self.seen = 0
        self.in_flight = 0
        self.started: float | None = None
        self.arrivals: list[tuple[float, int]] = []
        self.answers: list[int] = []

    async def handle(self, request: Request) -> Response:
        call = json.loads(await request.body())
        now = time.monotonic()
        self.started = self.started if self.started is not None else now
        since = now - self.started
        self.seen += 1
        throttled = self.seen <= self.throttle_first
        busy = self.busy_above is not None and since < self.busy_until and self.in_flight >= self.busy_above
        self.in_flight += 1
        self.arrivals.append((since, self.in_flight))
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if throttled:
            headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
            return self._answer(PlainTextResponse("busy, try later", status_code=self.status, headers=headers))
        if busy:
            return self._answer(PlainTextResponse("too many at once", status_code=429, headers={"Retry-After": "0"}))
        return self._answer(JSONResponse({"type": "function_call_output", "call_id": call["call_id"],
                                          "output": f"result for {call['arguments']}"}))

    def _answer(self, response: Response) -> Response:
        self.answers.append(response.status_code)
        return response

    def peak(self, start: float, end: float) -> int:
        """The most requests in flight that an arrival between `start` and `end` s saw."""
        return max((n for at, n in self.arrivals if start <= at < end), default=0)


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[BusyTool, str]]:
    tool = BusyTool()
    with serve_app(tool.app) as port:
        yield tool, f"http://127.0.0.1:{port}/tool"


@pytest.fixture
def server(running: tuple[BusyTool, str]) -> BusyTool:
    tool, url = running
    tool.reset()
    tool.url = url
    return tool


def calls(server: BusyTool, n: int, *, options: ToolClientOptions = FAST,
          **endpoint: Any) -> tuple[list[ToolResult], dict[str, dict[str, float]]]:
    """`n` concurrent calls of one tool (as many rollouts' would be), and the client's stats after."""
    tool = ToolEndpoint(name="search", server_url=server.url, **endpoint)

    async def go() -> tuple[list[ToolResult], dict[str, dict[str, float]]]:
        async with ToolClient([tool], allowlist=LOCAL, options=options) as client:
            results = await asyncio.gather(*(
                client.call(trace_id=f"trace_{i}", call_id=f"call_{i}", name="search",
                            arguments_json=json.dumps({"query": f"q{i}"}), item={}) for i in range(n)))
            return list(results), client.backpressure_stats()

    return asyncio.run(go())


# --- Retry-After ----------------------------------------------------------------------------------


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert retry_after_s("120") == 120.0 and retry_after_s(" 0 ") == 0.0
    assert retry_after_s(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert retry_after_s(formatdate(now - 30, usegmt=True), now=now) == 0.0  # a date already past
    assert retry_after_s(None) is None and retry_after_s("") is None and retry_after_s("soon") is None
    assert retry_after_s("inf") is None
    assert throttle_wait_s(429, {"retry-after": "120"}, cap_s=10) == 10.0
    assert throttle_wait_s(503, {"retry-after": "2"}, cap_s=10) == 2.0
    assert throttle_wait_s(500, {"retry-after": "2"}, cap_s=10) is None  # only 429 and 503 throttle
    assert throttle_wait_s(429, {}, cap_s=10) is None


def test_429_with_retry_after_is_waited_out_without_spending_retries(server: BusyTool) -> None:
    """The first 3 requests are throttled with Retry-After: 1; with `retries: 0`, every call still
    ends ok: the waits are counted, not charged to the retry budget."""
    server.reset(throttle_first=3, retry_after="1")
    started = time.monotonic()
    results, stats = calls(server, 4, retries=0)
    elapsed = time.monotonic() - started

    assert [r.status for r in results] == ["ok"] * 4
    assert sum(r.throttled for r in results) == 3
    assert sum(r.throttle_wait_s for r in results) == pytest.approx(3.0)
    throttled = [r for r in results if r.throttled]
    assert all(r.attempts == 2 and r.latency_s >= 0.95 for r in throttled)  # one wait of the asked second
    assert server.answers.count(429) == 3 and server.answers.count(200) == 4
    assert stats["search"]["throttled"] == 3 and stats["search"]["throttle_wait_s"] == pytest.approx(3.0)
    assert elapsed < 5


def test_503_with_an_http_date_waits_until_that_date(server: BusyTool) -> None:
    server.reset(throttle_first=1, status=503, retry_after=formatdate(time.time() + 2, usegmt=True))
    (result,), _ = calls(server, 1, retries=0)
    assert result.ok and result.throttled == 1
    assert 0.9 <= result.throttle_wait_s <= 2.0  # HTTP dates are whole seconds
    assert result.latency_s >= 0.9


def test_a_retry_after_above_the_cap_is_cut_to_the_cap(server: BusyTool) -> None:
    server.reset(throttle_first=2, retry_after="3600")
    options = ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02, max_retry_after_s=0.5)
    (result,), _ = calls(server, 1, options=options, retries=0)
    assert result.ok and result.throttled == 2 and result.attempts == 3
    assert result.throttle_wait_s == pytest.approx(1.0)
    assert 1.0 <= result.latency_s < 4


def test_throttled_waits_stop_being_free_past_the_calls_budget(server: BusyTool) -> None:
    """A server that only ever throttles cannot hold a call forever: past `max_throttle_wait_s`
    of waits, a throttled answer spends retries like any failure."""
    server.reset(throttle_first=1000, retry_after="1")
    options = ToolClientOptions(backoff_base_s=0.01, backoff_max_s=0.02, max_retry_after_s=0.2,
                                max_throttle_wait_s=0.5)
    (result,), _ = calls(server, 1, options=options, retries=1)
    assert result.status == "failed" and result.status_code == 429
    assert result.throttled == 2 and result.throttle_wait_s == pytest.approx(0.4)
    assert result.attempts == 4  # 2 waited out + the 2 that the budget of 1 + retries allows


def test_the_policy_counts_a_wait_cut_short_by_cancellation_as_far_as_it_went() -> None:
    """agent_rft.retry counts a throttled answer when it comes and its wait as it is waited: a
    deadline that cancels the call 0.3 s into a 1 s wait leaves 1 answer and 0.3 s counted."""
    async def throttled() -> str:
        return "429"

    async def go() -> dict[str, Any]:
        policy = async_retrying(attempts=1, base_s=0.01, max_s=0.02, retry=lambda state: True,
                                throttle=lambda state: 1.0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await policy(throttled)
        return policy.statistics

    statistics = asyncio.run(go())
    assert statistics["throttled"] == 1
    assert 0.25 <= statistics.get("throttle_wait_s", 0.0) <= 0.5  # not the whole second it asked


def test_a_429_without_retry_after_spends_a_retry(server: BusyTool) -> None:
    server.reset(throttle_first=1, retry_after=None)
    (result,), _ = calls(server, 1, retries=1)
    assert result.ok and result.attempts == 2 and result.throttled == 0
    server.reset(throttle_first=1, retry_after=None)
    (result,), _ = calls(server, 1, retries=0)
    assert result.status == "failed" and result.status_code == 429


# --- AIMD concurrency -----------------------------------------------------------------------------


def test_concurrency_halves_on_throttling_and_recovers_as_the_server_observes() -> None:
    """max_concurrency 8; for its first second the server throttles while 2 or more are in flight.
    What it sees: 8 at once at first, then no more than the 2-3 it copes with, then 8 again once
    it stops throttling, and every call ends ok."""
    tool = BusyTool()
    with serve_app(tool.app) as port:
        tool.reset(busy_above=2, busy_until=1.0, delay_s=0.02)
        tool.url = f"http://127.0.0.1:{port}/tool"
        results, stats = calls(tool, 500, max_concurrency=8)

    assert [r.status for r in results] == ["ok"] * 500
    assert tool.answers.count(429) > 0 and sum(r.throttled for r in results) == tool.answers.count(429)
    assert tool.peak(0.0, 0.05) == 8  # the first burst
    assert tool.peak(0.4, 1.0) <= 4  # halved to what it copes with (2, probing at 3)
    last = max(at for at, _ in tool.arrivals)
    assert last > 1.3, "the run ended before the recovery could be seen"
    assert tool.peak(1.3, last + 1) == 8  # crept back up to max_concurrency
    assert stats["search"]["concurrency"] == 8 and stats["search"]["max_concurrency"] == 8


def test_adaptive_limit_halves_once_per_round_and_grows_by_one_per_round() -> None:
    async def go() -> None:
        limit = AdaptiveLimit(8)
        burst = [await limit.acquire() for _ in range(8)]
        for slot in burst:  # a whole round throttled: one halving, not eight
            limit.release(slot, throttled=True)
        assert limit.limit == 4 and limit.throttled == 8
        slot = await limit.acquire()
        limit.release(slot, throttled=True)  # started after the decrease: halves again
        assert limit.limit == 2
        for expected in (3, 4):
            for _ in range(limit.limit):
                limit.release(await limit.acquire())
            assert limit.limit == expected
        held = [await limit.acquire() for _ in range(4)]
        waiter = asyncio.ensure_future(limit.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # at the limit, the next one waits
        limit.release(held.pop())
        limit.release(await waiter)
        for slot in held:
            limit.release(slot)
        assert limit.in_flight == 0

    asyncio.run(go())


# --- the rollout engine and the step's metrics ----------------------------------------------------


def rollouts(server: BusyTool, n: int, config: Any = None) -> tuple[list[Any], dict[str, dict[str, float]]]:
    """`n` rollouts whose first turn calls `search` (`retries: 0`) and whose second answers, and
    the tool client's stats after."""
    from tests.rl.policies import ScriptedPolicy
    from workers.models.loading import load_model
    from workers.engine.prompting import ChatFormatter
    from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
    from workers.engine.toolcalls import ToolSchema

    tokenizer = load_model("tiny-smollm2").tokenizer
    schema = ToolSchema("search", "Search", {"type": "object", "properties": {"query": {"type": "string"}}})
    turn = '<tool_call>{"name": "search", "arguments": {"query": "revenue"}}</tool_call>'
    policy = ScriptedPolicy(tokenizer, {"a": [turn, "The answer is 42."]})
    specs = [RolloutSpec(sample_index=i, messages=[{"role": "user", "content": f"Q{i}. SCRIPT=a"}],
                         tools=[schema], item={}, seed=i) for i in range(n)]

    async def go() -> tuple[list[Any], dict[str, dict[str, float]]]:
        endpoint = {"name": "search", "server_url": server.url, "retries": 0}
        async with ToolClient([endpoint], allowlist=LOCAL, options=FAST) as client:
            engine = RolloutEngine(policy, tokenizer, ChatFormatter(tokenizer), client, config or EngineConfig())
            return await engine.run(specs), client.backpressure_stats()

    return asyncio.run(go())


def test_rollouts_are_kept_and_the_waits_reach_the_step_metrics(server: BusyTool) -> None:
    """8 rollouts each call a tool whose first 4 answers are 429 Retry-After: 1, with `retries: 0`:
    every rollout is answered (none dropped as a tool failure), and the step's `tools` block
    counts the throttled answers, the seconds waited and the concurrency."""
    from app.dashboard.charts import charted_keys
    from app.jobs.worker_service import flatten_metrics
    from workers.engine.summary import summarize

    server.reset(throttle_first=4, retry_after="1")
    records, _ = rollouts(server, 8)
    assert [r.finish_reason for r in records] == ["answered"] * 8
    tools = summarize(records)
    assert tools["tool_throttled_by_tool"] == {"search": 4}
    assert tools["tool_throttle_wait_s_by_tool"]["search"] == pytest.approx(4.0)
    assert 1 <= tools["tool_concurrency_by_tool"]["search"] <= 16
    assert tools["tool_error_rate_by_tool"] == {"search": 0.0}
    flat = flatten_metrics({"tools": tools})
    _, prefixes, _ = charted_keys()
    for prefix in ("tools.tool_throttled_by_tool.", "tools.tool_throttle_wait_s_by_tool.",
                   "tools.tool_concurrency_by_tool."):
        assert prefix in prefixes and f"{prefix}search" in flat


def test_throttling_is_counted_when_the_rollouts_deadline_cancels_the_call(server: BusyTool) -> None:
    """The tool answers 429 Retry-After: 1 to every request, and the rollout's deadline (2 s)
    cancels its call in the middle of the second wait: the rollout is a tool failure, and its
    record, the step's `tools` block and the client's stats count both throttled answers and the
    seconds actually waited (the cut-short wait only as far as it went, not the second it asked)."""
    from workers.engine.rollout import EngineConfig
    from workers.engine.summary import summarize

    server.reset(throttle_first=1000, retry_after="1")
    (record,), stats = rollouts(server, 1, EngineConfig(rollout_timeout_s=2.0))

    assert record.finish_reason == "tool_failure" and 2.0 <= record.wall_time_s < 3
    (call,) = record.tool_calls
    assert call.status == "failed" and "deadline of 2 s" in call.error
    # The first turn's generation (well under a second), answers 1 s apart, the deadline at 2 s.
    assert server.answers == [429, 429], "timing: the deadline did not fall in the second wait"
    assert call.throttled == 2 and 1.0 < call.throttle_wait_s < 2.0  # the first wait, part of the second
    assert call.throttle_wait_s <= call.latency_s
    tools = summarize([record])
    assert tools["tool_throttled_by_tool"] == {"search": 2}
    assert tools["tool_throttle_wait_s_by_tool"] == {"search": call.throttle_wait_s}
    assert stats["search"]["throttled"] == 2 and stats["search"]["throttle_wait_s"] == call.throttle_wait_s
