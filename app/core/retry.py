"""The one retry policy for outbound HTTP: what is transient, how long to wait, when to stop.

Used by the worker's control-plane client, the rollout engine's tool client and the graders'
outbound calls (endpoint grader, remote judges). Every caller retries the same things:

- an answer with a retryable status: 408 (request timeout), 429 (too many requests), any 5xx;
  every other status is final (a 4xx is the caller's mistake, a 3xx is not followed);
- a transport error: `httpx.TransportError` (connection refused or reset, timeouts, protocol
  errors) or a `TimeoutError` from a deadline the caller put around one attempt.

Waits grow exponentially with equal jitter (half fixed, half random), so the retries of many
concurrent callers spread out instead of arriving together. After the last attempt its outcome
stands: a response is returned as it is, an exception raised as it is.

Imports only httpx, tenacity and the standard library (app/ never imports torch).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception, retry_if_result, stop_after_attempt
from tenacity.retry import retry_base
from tenacity.wait import wait_base

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
EXCERPT_CHARS = 300  # how much of a body an error message quotes


def retryable_status(status_code: int) -> bool:
    """Whether an HTTP answer with this status is worth another try."""
    return status_code in RETRYABLE_STATUS


def retryable_error(exc: BaseException) -> bool:
    """Whether an exception raised by one attempt is worth another try."""
    return isinstance(exc, (httpx.TransportError, TimeoutError))


def _retryable_response(result: Any) -> bool:
    return isinstance(result, httpx.Response) and retryable_status(result.status_code)


# For callers whose attempt returns the httpx.Response or raises the transport error itself.
retry_transient_http: retry_base = retry_if_exception(retryable_error) | retry_if_result(_retryable_response)


class Backoff(wait_base):
    """Exponential backoff with equal jitter: the n-th retry waits between d/2 and d, where
    d = min(max_s, base_s * 2**(n-1))."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s, self.max_s = base_s, max_s

    def delay(self, retry_number: int) -> float:
        ceiling = min(self.max_s, self.base_s * 2 ** (retry_number - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)  # the attempt that just failed: retry n follows attempt n


def _last_outcome(retry_state: RetryCallState) -> Any:
    return retry_state.outcome.result()  # type: ignore[union-attr]  # returns the result or raises the exception


def _policy(attempts: int, retry: retry_base, base_s: float, max_s: float,
            before_sleep: Callable[[RetryCallState], Any] | None) -> dict[str, Any]:
    return {"stop": stop_after_attempt(max(1, attempts)), "retry": retry, "wait": Backoff(base_s, max_s),
            "before_sleep": before_sleep, "retry_error_callback": _last_outcome}


def retrying(*, attempts: int, base_s: float, max_s: float, retry: retry_base = retry_transient_http,
             before_sleep: Callable[[RetryCallState], Any] | None = None,
             sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """A synchronous policy: `retrying(...)(fn, *args)` calls fn up to `attempts` times in all.

    Make one per call: its `statistics["attempt_number"]` then counts that call's attempts.
    """
    return Retrying(sleep=sleep, **_policy(attempts, retry, base_s, max_s, before_sleep))


def async_retrying(*, attempts: int, base_s: float, max_s: float, retry: retry_base = retry_transient_http,
                   before_sleep: Callable[[RetryCallState], Any] | None = None,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncRetrying:
    """The same policy for coroutines: `await async_retrying(...)(coro_fn, *args)`. One per call
    (its statistics are per object, and concurrent calls on one loop would share them)."""
    return AsyncRetrying(sleep=sleep, **_policy(attempts, retry, base_s, max_s, before_sleep))


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` stripped, cut to `limit` characters with "…" when longer: how an error message or
    an attempt log quotes a body."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "…"
