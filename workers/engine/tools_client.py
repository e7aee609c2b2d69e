"""Calls to the customer's tool servers during rollouts (the contract: docs/tool-server.md).

`POST {server_url}` with the tool's headers and
`{"type": "function_call", "id": "fc_…", "call_id", "name", "arguments": "<JSON string>",
"trace_id", "item"}`; the reply is `{"type": "function_call_output", "call_id", "output"}` (a
plain-text 200 body is accepted as the output too).

Outcomes, as `ToolResult.status`:
- `ok`: the output goes to the model (cut to the size cap with a notice saying so).
- `client_error`: a 4xx; its body goes to the model as the tool's output, so it can recover.
- `failed`: 5xx, 408/429, connection errors or timeouts on every attempt (1 + `retries`), or a
  redirect (not followed). The engine drops the rollout from the update and counts a tool failure.
  Backpressure is not failure: a 429/503 with Retry-After is waited out (at most
  `max_retry_after_s`) without spending a retry, and any 429/503 halves the tool's concurrency,
  which creeps back up to `max_concurrency` on success (AIMD, agent_rft.concurrency).
- `blocked`: the SSRF guard refused the URL (no retries).
- `unknown_tool`: no tool of that name is configured for the job.
- `skipped`: the variance diagnostic was told to skip tools that are not read-only.
`call` never raises (except on cancellation): a tool cannot crash a job. A cancelled call (the
rollout's deadline) hands its `on_cancel` what it did until then: its throttled answers and the
seconds it waited count like a finished call's.

Every request carries `Idempotency-Key` (the same on every attempt of one call, agent_rft.tracing)
and a W3C `traceparent` naming the rollout's trace (a new span id per attempt). A tool declared
`read_only` with `cache` is answered from this client's cache (one per job) for an identical call;
identical calls already in flight wait for the first one instead of calling again.

One `ToolClient` per job and event loop: its pooled httpx client, concurrency limits and rate limiters
belong to the loop that first uses them.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from aiolimiter import AsyncLimiter
from tenacity import AsyncRetrying, RetryCallState, retry_if_result

from agent_rft.ids import new_id
from agent_rft.concurrency import Backpressure
from agent_rft.retry import (
    THROTTLE_STATUS,
    async_retrying,
    excerpt,
    retryable_error,
    retryable_status,
    throttle_counts,
    throttle_wait_s,
)
from agent_rft.tracing import idempotency_key, traceparent
from agent_rft.urls import BlockedURL, Resolver, guarded_client
from workers.spans import current_span_id
from workers.metrics import record_tool_call

logger = logging.getLogger(__name__)

ToolStatus = Literal["ok", "client_error", "failed", "blocked", "unknown_tool", "skipped"]
NonReadOnly = Literal["call", "skip", "dry_run"]  # what the variance diagnostic does with side-effecting tools

# The headers of the call being sent (trace_id, Idempotency-Key), set by `call` for the attempts it
# makes: they differ per call while everything else about a request is the tool's.
_CALL_CONTEXT: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("tool_call", default=None)


@dataclass(frozen=True)
class ToolEndpoint:
    """Where calls to one tool go. `max_concurrency` / `rate_limit` (requests per second),
    `timeout_s` (one attempt in all, the job's `timeout`) and `retries` override the client's
    defaults for this tool."""

    name: str
    server_url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    max_concurrency: int | None = None
    rate_limit: float | None = None
    timeout_s: float | None = None
    retries: int | None = None
    read_only: bool = False
    cache_ttl_s: float | None = None  # None: not cached; math.inf: for the client's lifetime (the job)
    cache_per_item: bool = True  # the cache key includes the call's item

    @classmethod
    def from_spec(cls, spec: ToolEndpoint | Mapping[str, Any] | Any) -> ToolEndpoint:
        """From a ToolEndpoint, a dict, or any object with name/server_url/headers (the job's
        `method.reinforcement.tools` entries)."""
        if isinstance(spec, ToolEndpoint):
            return spec
        get = spec.get if isinstance(spec, Mapping) else lambda key, default=None: getattr(spec, key, default)
        if not get("name") or not get("server_url"):
            raise ValueError(f"a tool needs a name and a server_url, got {spec!r}")
        return cls(
            name=get("name"), server_url=get("server_url"), headers=dict(get("headers") or {}),
            max_concurrency=get("max_concurrency"), rate_limit=get("rate_limit"), timeout_s=get("timeout"),
            retries=get("retries"), read_only=bool(get("read_only", False)),
            cache_ttl_s=_cache_ttl(get("cache", False)), cache_per_item=get("cache_per_item", True) is not False,
        )


def _cache_ttl(cache: Any) -> float | None:
    """`cache: true` is the job's lifetime, a number that many seconds, false/None off."""
    if cache is True:
        return math.inf
    if isinstance(cache, (int, float)) and not isinstance(cache, bool) and cache > 0:
        return float(cache)
    return None


@dataclass(frozen=True)
class ToolClientOptions:
    max_concurrency: int = 16  # in-flight requests per tool; AIMD below it on throttling (agent_rft.concurrency)
    rate_limit: float | None = None  # requests per second per tool; None: unlimited
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0  # longest silence while waiting for / reading the reply
    attempt_timeout_s: float = 120.0  # whole attempt, so a server trickling bytes cannot hang a rollout
    retries: int = 3
    backoff_base_s: float = 0.5  # first backoff; doubled per retry, with jitter (agent_rft.retry)
    backoff_max_s: float = 8.0
    # A 429/503 with Retry-After waits what it asks, at most this long, without spending `retries`...
    max_retry_after_s: float = 60.0
    # ...until a call has waited this long in all; then throttled answers spend retries like failures.
    max_throttle_wait_s: float = 1800.0
    max_output_bytes: int = 1_048_576


@dataclass
class ToolResult:
    name: str
    call_id: str
    status: ToolStatus
    output: str  # what the model sees as the tool's output
    status_code: int | None = None  # HTTP status of the last attempt
    reply: str | None = None  # the last attempt's reply body as received (cut at the size cap)
    latency_s: float = 0.0  # wall time of the whole call, retries and waits included
    bytes: int = 0  # size of the reply body (Content-Length when the server declared one)
    attempts: int = 0
    error: str | None = None  # why the call did not succeed, for logs and metrics
    truncated: bool = False
    cached: bool = False  # answered from the tool-result cache, without a request
    throttled: int = 0  # answers that asked to wait (429/503 with Retry-After): waited out, no retry spent
    throttle_wait_s: float = 0.0  # seconds those answers made the call wait
    concurrency: int | None = None  # the tool's concurrency limit when the call ended (AIMD)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _ResultCache:
    """One tool's cached results: key -> (expiry on the monotonic clock, result). `waiting` holds an
    event per key whose first call is in flight, so identical concurrent calls make one request."""

    ttl_s: float
    entries: dict[tuple[str, str], tuple[float, ToolResult]] = field(default_factory=dict)
    waiting: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    lookups: int = 0
    hits: int = 0

    def get(self, key: tuple[str, str]) -> ToolResult | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if time.monotonic() >= entry[0]:
            del self.entries[key]
            return None
        return entry[1]

    def put(self, key: tuple[str, str], result: ToolResult) -> None:
        self.entries[key] = (time.monotonic() + self.ttl_s, result)


@dataclass
class _Attempt:
    """The outcome of one HTTP request."""

    status: ToolStatus
    output: str = ""
    status_code: int | None = None
    reply: str | None = None
    size: int = 0
    truncated: bool = False
    error: str | None = None
    retryable: bool = False
    throttled: bool = False  # a 429/503: the tool's concurrency halves
    retry_after_s: float | None = None  # what its Retry-After asked, cut to the cap
    # Of the whole call, set on its last attempt by _send_with_retries.
    throttled_answers: int = 0
    throttle_wait_s: float = 0.0
    concurrency: int | None = None


class _Tool:
    def __init__(self, endpoint: ToolEndpoint, options: ToolClientOptions) -> None:
        self.endpoint = endpoint
        self.headers = httpx.Headers(dict(endpoint.headers))
        self.headers["Content-Type"] = "application/json"
        # Compressed replies could expand past the size cap before it is checked.
        self.headers["Accept-Encoding"] = "identity"
        self.concurrency = endpoint.max_concurrency or options.max_concurrency
        # Halves on throttling, creeps back up on success; counts the waits over the client's life.
        self.backpressure = Backpressure.up_to(self.concurrency)
        rate = endpoint.rate_limit or options.rate_limit
        # One request every 1/rate seconds, no initial burst: no second ever holds more than `rate`.
        self.limiter = AsyncLimiter(1, 1 / rate) if rate else None
        self.retries = options.retries if endpoint.retries is None else endpoint.retries
        self.attempt_timeout_s = endpoint.timeout_s or options.attempt_timeout_s
        # A tool given its own timeout may also stay silent that long (a slow search, a long job).
        read_s = endpoint.timeout_s or options.read_timeout_s
        self.timeout = httpx.Timeout(read_s, connect=options.connect_timeout_s, pool=options.connect_timeout_s)


class ToolClient:
    """Calls a job's tools: pooled connections, retries, size cap, per-tool limits, SSRF guard."""

    def __init__(
        self,
        tools: Iterable[ToolEndpoint | Mapping[str, Any] | Any],
        *,
        allowlist: Iterable[str] = (),
        options: ToolClientOptions | None = None,
        resolver: Resolver | None = None,
        non_read_only: NonReadOnly = "call",
    ) -> None:
        self.options = options or ToolClientOptions()
        self.non_read_only = non_read_only
        self._tools: dict[str, _Tool] = {}
        for spec in tools:
            endpoint = ToolEndpoint.from_spec(spec)
            if endpoint.name in self._tools:
                raise ValueError(f"tool '{endpoint.name}' is configured twice")
            self._tools[endpoint.name] = _Tool(endpoint, self.options)
        # Per job (this client lives for the whole run): only read-only tools that opted in.
        self._caches = {tool.endpoint.name: _ResultCache(tool.endpoint.cache_ttl_s) for tool in self._tools.values()
                        if tool.endpoint.read_only and tool.endpoint.cache_ttl_s is not None}
        # Enough connections for every tool at its limit: the concurrency limits, not the pool, decide waits.
        connections = max(1, sum(tool.concurrency for tool in self._tools.values()))
        opts = self.options
        self._http = guarded_client(
            allowlist,
            resolver=resolver,
            timeout=httpx.Timeout(opts.read_timeout_s, connect=opts.connect_timeout_s, pool=opts.connect_timeout_s),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )

    @property
    def tool_names(self) -> list[str]:
        return list(self._tools)

    async def __aenter__(self) -> ToolClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """Per cached tool: lookups, hits, calls saved (one request per hit) and the hit rate, so far."""
        return {name: {"lookups": c.lookups, "hits": c.hits, "calls_saved": c.hits,
                       "hit_rate": c.hits / c.lookups if c.lookups else 0.0} for name, c in self._caches.items()}

    async def call(self, *, trace_id: str, call_id: str, name: str, arguments_json: str, item: dict,
                   on_cancel: Callable[[ToolResult], None] | None = None, item_id: str | None = None) -> ToolResult:
        """POST one function call to its tool server and return what the model should see. The
        body's `id` is `item_id`, else a new `fc_` id.

        Cancelled, it first hands `on_cancel` a failed result of what the call did until then."""
        result = await self._call(trace_id=trace_id, call_id=call_id, name=name, arguments_json=arguments_json,
                                  item=item, on_cancel=on_cancel, item_id=item_id)
        record_tool_call(name, result.status, result.latency_s, known=name in self._tools)
        return result

    async def _call(self, *, trace_id: str, call_id: str, name: str, arguments_json: str, item: dict,
                    on_cancel: Callable[[ToolResult], None] | None, item_id: str | None) -> ToolResult:
        started = time.monotonic()
        tool = self._tools.get(name)
        if tool is None:
            available = ", ".join(sorted(self._tools)) or "none"
            message = f"error: unknown tool '{name}'; available tools: {available}"
            return ToolResult(name=name, call_id=call_id, status="unknown_tool", output=message, error=message)
        if not isinstance(arguments_json, str):  # the wire format wants a JSON string, always
            arguments_json = json.dumps(arguments_json)
        side_effects = not tool.endpoint.read_only
        if side_effects and self.non_read_only == "skip":
            message = f"error: the call of '{name}' was skipped: it is not read-only and this run skips such tools"
            return ToolResult(name=name, call_id=call_id, status="skipped", output=message, error=message)
        body = {"type": "function_call", "id": item_id or new_id("fc_"), "call_id": call_id, "name": name,
                "arguments": arguments_json, "trace_id": trace_id, "item": item}
        if side_effects and self.non_read_only == "dry_run":
            body["dry_run"] = True
        try:
            content = json.dumps(body).encode()
        except (TypeError, ValueError) as exc:
            error = f"the call cannot be sent as JSON: {exc}"
            return ToolResult(name=name, call_id=call_id, status="failed", output=f"error: {error}", error=error)

        policy = self._retry_policy(tool)

        async def send() -> ToolResult:
            token = _CALL_CONTEXT.set((trace_id, idempotency_key(trace_id, call_id)))
            try:
                attempt, attempts = await self._send_with_retries(tool, content, policy)
            finally:
                _CALL_CONTEXT.reset(token)
            return self._result(name, call_id, attempt, attempts, time.monotonic() - started)

        try:
            return await self._send_or_cached(tool, send, arguments_json, item, call_id=call_id, started=started)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel(self._cancelled_result(tool, call_id, policy, time.monotonic() - started))
            raise

    async def _send_or_cached(self, tool: _Tool, send: Any, arguments_json: str, item: dict, *, call_id: str,
                              started: float) -> ToolResult:
        cache = self._caches.get(tool.endpoint.name)
        if cache is None:
            return await send()
        key = _cache_key(arguments_json, item if tool.endpoint.cache_per_item else None)
        return await self._cached(cache, key, send, call_id=call_id, started=started)

    async def _cached(self, cache: _ResultCache, key: tuple[str, str], send: Any, *, call_id: str,
                      started: float) -> ToolResult:
        """A hit (the cached result under this call's id), or the call itself, whose ok result is kept."""
        cache.lookups += 1
        while True:
            hit = cache.get(key)
            if hit is not None:
                cache.hits += 1
                # No request was made: no attempts, and nothing waited for.
                return dataclasses.replace(hit, call_id=call_id, cached=True, attempts=0, throttled=0,
                                           throttle_wait_s=0.0, latency_s=time.monotonic() - started)
            in_flight = cache.waiting.get(key)
            if in_flight is None:
                break
            await in_flight.wait()  # then a hit, or (it failed) this call goes out itself
        cache.waiting[key] = event = asyncio.Event()
        try:
            result = await send()
            if result.ok:
                cache.put(key, result)
            return result
        finally:
            del cache.waiting[key]
            event.set()

    def _retry_policy(self, tool: _Tool) -> AsyncRetrying:
        """One call's retry policy (agent_rft.retry): its statistics count that call's attempts, and
        its throttled answers and waits as they happen."""
        def log_retry(retry_state: RetryCallState) -> None:
            logger.info("tool %s: attempt %d failed (%s); retrying", tool.endpoint.name,
                        retry_state.attempt_number, retry_state.outcome.result().error)

        opts = self.options
        return async_retrying(attempts=1 + max(0, tool.retries), base_s=opts.backoff_base_s,
                              max_s=opts.backoff_max_s, retry=retry_if_result(_is_retryable), before_sleep=log_retry,
                              throttle=_asked_wait, throttle_budget_s=opts.max_throttle_wait_s)

    async def _send_with_retries(self, tool: _Tool, content: bytes, policy: AsyncRetrying) -> tuple[_Attempt, int]:
        """The last attempt's outcome and how many were made (1 + `retries` at most)."""
        try:
            attempt = await policy(self._send_once, tool, content)
        finally:  # a cancelled call's throttled answers and waits happened too: the tool's stats count them
            throttled, waited = tool.backpressure.count(policy.statistics)
        attempt.throttled_answers, attempt.throttle_wait_s = throttled, waited
        attempt.concurrency = tool.backpressure.limit.limit
        return attempt, policy.statistics["attempt_number"]

    def _cancelled_result(self, tool: _Tool, call_id: str, policy: AsyncRetrying, latency_s: float) -> ToolResult:
        """A call cancelled before it ended: failed, with the throttled answers and the seconds
        waited that its policy counted until then (none while it only waited for the cache)."""
        throttled, waited = throttle_counts(policy.statistics)
        error = "cancelled before the call ended"
        return ToolResult(name=tool.endpoint.name, call_id=call_id, status="failed", output=f"error: {error}",
                          latency_s=latency_s, error=error, throttled=throttled, throttle_wait_s=waited,
                          concurrency=tool.backpressure.limit.limit)

    def backpressure_stats(self) -> dict[str, dict[str, float]]:
        """Per tool, over this client's life: answers that asked to wait, the seconds waited for
        them, the current concurrency limit and its ceiling."""
        return {name: tool.backpressure.stats() for name, tool in self._tools.items()}

    async def _send_once(self, tool: _Tool, content: bytes) -> _Attempt:
        async with tool.backpressure.limit.held() as hold:
            attempt = await self._send_in_slot(tool, content)
            hold.throttled = attempt.throttled
            return attempt

    async def _send_in_slot(self, tool: _Tool, content: bytes) -> _Attempt:
        if tool.limiter is not None:
            await tool.limiter.acquire()
        try:
            async with asyncio.timeout(tool.attempt_timeout_s):
                return await self._post(tool, content)
        except BlockedURL as exc:
            return _Attempt(status="blocked", output=f"error: tool URL refused: {exc}", error=str(exc))
        except (httpx.TimeoutException, TimeoutError) as exc:
            error = (f"timeout ({type(exc).__name__}; limits: connect {tool.timeout.connect:g} s, "
                     f"read {tool.timeout.read:g} s, attempt {tool.attempt_timeout_s:g} s)")
            return _Attempt(status="failed", error=error, retryable=retryable_error(exc))
        except httpx.TransportError as exc:
            return _Attempt(status="failed", error=f"{type(exc).__name__}: {exc}", retryable=retryable_error(exc))
        except Exception as exc:  # noqa: BLE001 - whatever goes wrong is the tool's failure, not the job's
            logger.warning("tool %s: unexpected error", tool.endpoint.name, exc_info=True)
            return _Attempt(status="failed", error=f"{type(exc).__name__}: {exc}")

    async def _post(self, tool: _Tool, content: bytes) -> _Attempt:
        cap = self.options.max_output_bytes
        async with self._http.stream("POST", tool.endpoint.server_url, content=content, headers=_call_headers(tool),
                                     timeout=tool.timeout) as response:
            raw, received = await _read_capped(response, cap)
        text = raw.decode(response.encoding or "utf-8", errors="replace")
        return self._attempt_from(response, text, size=max(received, _declared_length(response)), truncated=received > cap)

    def _attempt_from(self, response: httpx.Response, text: str, *, size: int, truncated: bool) -> _Attempt:
        """Classify one reply: output for the model, a transient failure, or a final one."""
        code = response.status_code
        if response.is_success:
            output = text if truncated else _output_from(text)  # a cut-off JSON reply cannot be parsed
            return _Attempt(status="ok", output=self._with_truncation_notice(output, truncated), status_code=code,
                            reply=text, size=size, truncated=truncated)
        if retryable_status(code):
            return _Attempt(status="failed", status_code=code, size=size, retryable=True,
                            error=f"HTTP {code}: {excerpt(text)}", throttled=code in THROTTLE_STATUS,
                            retry_after_s=throttle_wait_s(code, response.headers, self.options.max_retry_after_s))
        if 400 <= code < 500:
            output = text if text.strip() else f"error: the tool answered HTTP {code} {response.reason_phrase}"
            return _Attempt(status="client_error", output=self._with_truncation_notice(output, truncated),
                            status_code=code, reply=text, size=size, truncated=truncated,
                            error=f"HTTP {code}: {excerpt(text)}")
        location = response.headers.get("location", "")
        error = f"HTTP {code}" + (f" redirect to {location} (redirects are not followed)" if location else "")
        return _Attempt(status="failed", status_code=code, size=size, error=error)

    def _with_truncation_notice(self, output: str, truncated: bool) -> str:
        if not truncated:
            return output
        cap = self.options.max_output_bytes
        return f"[output truncated: the tool returned more than {cap} bytes; showing the first {cap}]\n{output}"

    def _result(self, name: str, call_id: str, attempt: _Attempt, attempts: int, latency_s: float) -> ToolResult:
        output = attempt.output
        if attempt.status == "failed":
            output = f"error: the tool call failed after {attempts} attempt(s): {attempt.error}"
        return ToolResult(
            name=name, call_id=call_id, status=attempt.status, output=output, status_code=attempt.status_code,
            reply=attempt.reply, latency_s=latency_s, bytes=attempt.size, attempts=attempts, error=attempt.error,
            truncated=attempt.truncated, throttled=attempt.throttled_answers, throttle_wait_s=attempt.throttle_wait_s,
            concurrency=attempt.concurrency,
        )


def _call_headers(tool: _Tool) -> httpx.Headers:
    """The tool's headers plus this call's Idempotency-Key and a traceparent with a new span id
    (each attempt is its own span of the rollout's trace)."""
    headers = httpx.Headers(tool.headers)
    context = _CALL_CONTEXT.get()
    if context is not None:
        trace_id, key = context
        headers["Idempotency-Key"] = key
        # With spans on, the header names the tool call's span, so the server's spans are its children.
        headers["traceparent"] = traceparent(trace_id, current_span_id(trace_id))
    return headers


def _cache_key(arguments_json: str, item: Any) -> tuple[str, str]:
    """(canonical JSON of the arguments, canonical JSON of the item or ""): key order and spacing
    do not matter; arguments that are not JSON are keyed as they are."""
    try:
        arguments = json.dumps(json.loads(arguments_json), sort_keys=True, separators=(",", ":"))
    except ValueError:
        arguments = arguments_json
    scope = "" if item is None else json.dumps(item, sort_keys=True, separators=(",", ":"), default=str)
    return arguments, scope


async def _read_capped(response: httpx.Response, cap: int) -> tuple[bytes, int]:
    """At most `cap` bytes of the body, and how many were received (cap + 1 or more when the body
    is longer: reading stops there instead of loading an unbounded body)."""
    chunks: list[bytes] = []
    received = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        received += len(chunk)
        if received > cap:
            break
    return b"".join(chunks)[:cap], received


def _declared_length(response: httpx.Response) -> int:
    try:
        return int(response.headers.get("content-length", 0))
    except ValueError:
        return 0


def _output_from(text: str) -> str:
    """The `output` of a function_call_output reply; any other body is the output as it is."""
    try:
        reply = json.loads(text)
    except ValueError:
        return text
    if isinstance(reply, dict) and "output" in reply:
        output = reply["output"]
        return output if isinstance(output, str) else json.dumps(output)
    return text


def _is_retryable(attempt: _Attempt) -> bool:
    return attempt.retryable


def _asked_wait(retry_state: RetryCallState) -> float | None:
    """The policy's `throttle`: what a failed attempt's Retry-After asked (agent_rft.retry)."""
    return retry_state.outcome.result().retry_after_s  # type: ignore[union-attr]
