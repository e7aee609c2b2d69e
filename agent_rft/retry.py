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

Backpressure is not failure: a caller may pass `throttle`, which reads a failed attempt's
outcome for a throttled answer (429 or 503 with Retry-After, `throttle_wait_s`). Such an answer
is waited out as long as it asks (the caller cut it to its cap) and spends none of the
`attempts`, until `throttle_budget_s` of such waits is spent in the call; the policy object's
`statistics["throttled"]` and `["throttle_wait_s"]` count them as they happen (`throttle_counts`),
so a call cancelled mid-wait (a deadline around it) still says what it went through: a wait cut
short counts the seconds it lasted.

Imports only httpx, tenacity and the standard library (app/ never imports torch).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timezone
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception, retry_if_result, stop_after_attempt
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
THROTTLE_STATUS = frozenset({429, 503})  # the server is busy, not broken: slow down
EXCERPT_CHARS = 300  # how much of a body an error message quotes


def retryable_status(status_code: int) -> bool:
    """Whether an HTTP answer with this status is worth another try."""
    return status_code in RETRYABLE_STATUS


def retryable_error(exc: BaseException) -> bool:
    """Whether an exception raised by one attempt is worth another try."""
    return isinstance(exc, (httpx.TransportError, TimeoutError))


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """The wait a Retry-After header asks for, in seconds: delta-seconds ("120") or an HTTP date
    ("Wed, 21 Oct 2015 07:28:00 GMT"); a date in the past is 0. None when absent or unreadable."""
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT; parsedate gives "-0000" as naive
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def throttle_wait_s(status_code: int, headers: Mapping[str, str], cap_s: float) -> float | None:
    """How long a throttled answer (429 or 503 with a readable Retry-After) asks to wait, cut to
    `cap_s`; None for any other answer."""
    if status_code not in THROTTLE_STATUS:
        return None
    asked = retry_after_s(headers.get("retry-after"))
    return None if asked is None else min(asked, cap_s)


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


def throttle_counts(statistics: Mapping[str, Any]) -> tuple[int, float]:
    """A policy's throttled answers and the seconds waited for them so far (its `statistics`)."""
    return statistics.get("throttled", 0), statistics.get("throttle_wait_s", 0.0)


class _Throttling:
    """One call's throttled attempts: which ones asked to wait, and how long. Stop and wait both
    ask about the same attempt (in an order tenacity decides), so the answer is kept per attempt.

    Counts into the policy's statistics as it goes, not when the call returns: a caller's deadline
    may cancel the call in the middle of a wait, and what it waited until then still happened."""

    def __init__(self, wait_for: Callable[[RetryCallState], float | None], budget_s: float,
                 sleep: Callable[[float], Awaitable[None]]) -> None:
        self.wait_for, self.budget_s, self._sleep = wait_for, budget_s, sleep
        self.waits: dict[int, float | None] = {}  # attempt number -> its throttle wait; None: a plain failure
        self.statistics: dict[str, Any] = {}  # the policy's, bound at the first throttled answer

    def wait_of(self, retry_state: RetryCallState) -> float | None:
        number = retry_state.attempt_number
        if number not in self.waits:
            wait = self.wait_for(retry_state)
            if wait is not None and self.waited_s + wait > self.budget_s:
                wait = None  # the budget is spent: from now on a throttled answer counts as a failure
            self.waits[number] = wait
            if wait is not None:
                self.statistics = retry_state.retry_object.statistics
                self.statistics["throttled"] = self.statistics.get("throttled", 0) + 1
        return self.waits[number]

    @property
    def waited_s(self) -> float:
        """The waits granted so far: what spends the budget."""
        return sum(w for w in self.waits.values() if w is not None)

    async def sleep(self, seconds: float) -> None:
        """The policy's sleep. Tenacity sleeps only after both stop and wait assessed the failed
        attempt, so the latest attempt's wait says whether this is a throttle wait (None: a backoff)."""
        asked = self.waits.get(max(self.waits, default=0))
        if asked is None:
            await self._sleep(seconds)
            return
        started = time.monotonic()
        try:
            await self._sleep(seconds)
        except BaseException:  # cut short (the call was cancelled): only the part that elapsed was waited
            self._count_wait(min(asked, time.monotonic() - started))
            raise
        self._count_wait(asked)

    def _count_wait(self, seconds: float) -> None:
        self.statistics["throttle_wait_s"] = self.statistics.get("throttle_wait_s", 0.0) + seconds

    def spent_attempts(self, retry_state: RetryCallState) -> int:
        """Attempts so far that count against the call's `attempts` (the throttled ones do not)."""
        self.wait_of(retry_state)
        return sum(1 for n in range(1, retry_state.attempt_number + 1) if self.waits.get(n) is None)


class _StopAfterSpent(stop_base):
    def __init__(self, attempts: int, throttling: _Throttling) -> None:
        self.attempts, self.throttling = attempts, throttling

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.throttling.spent_attempts(retry_state) >= self.attempts


class _WaitAsAsked(wait_base):
    """A throttled attempt waits what it asked; any other failure backs off by the failures so far."""

    def __init__(self, backoff: Backoff, throttling: _Throttling) -> None:
        self.backoff, self.throttling = backoff, throttling

    def __call__(self, retry_state: RetryCallState) -> float:
        asked = self.throttling.wait_of(retry_state)
        if asked is not None:
            return asked
        return self.backoff.delay(max(1, self.throttling.spent_attempts(retry_state)))


def _last_outcome(retry_state: RetryCallState) -> Any:
    return retry_state.outcome.result()  # type: ignore[union-attr]  # returns the result or raises the exception


class _StopAfterDeadline(stop_base):
    """Stops once time.monotonic() has passed `deadline()` (read at every failed attempt, so the
    caller may move it while the call is retrying)."""

    def __init__(self, deadline: Callable[[], float]) -> None:
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return time.monotonic() >= self.deadline()


def _policy(attempts: int, retry: retry_base, base_s: float, max_s: float,
            before_sleep: Callable[[RetryCallState], Any] | None, sleep: Callable[[float], Any],
            throttle: Callable[[RetryCallState], float | None] | None = None,
            throttle_budget_s: float = math.inf, until: Callable[[], float] | None = None) -> dict[str, Any]:
    stop: stop_base = stop_after_attempt(max(1, attempts))
    wait: wait_base = Backoff(base_s, max_s)
    if throttle is not None:
        throttling = _Throttling(throttle, throttle_budget_s, sleep)
        stop, wait = _StopAfterSpent(max(1, attempts), throttling), _WaitAsAsked(Backoff(base_s, max_s), throttling)
        sleep = throttling.sleep
    if until is not None:  # at least `attempts`, and on until the deadline
        stop = stop & _StopAfterDeadline(until)
    return {"stop": stop, "retry": retry, "wait": wait, "sleep": sleep, "before_sleep": before_sleep,
            "retry_error_callback": _last_outcome}


def retrying(*, attempts: int, base_s: float, max_s: float, retry: retry_base = retry_transient_http,
             before_sleep: Callable[[RetryCallState], Any] | None = None,
             sleep: Callable[[float], None] = time.sleep, until: Callable[[], float] | None = None) -> Retrying:
    """A synchronous policy: `retrying(...)(fn, *args)` calls fn up to `attempts` times in all, or,
    with `until` (a time.monotonic() deadline, read after each failure), at least `attempts` times
    and then on while the deadline has not passed.

    Make one per call: its `statistics["attempt_number"]` then counts that call's attempts.
    """
    return Retrying(**_policy(attempts, retry, base_s, max_s, before_sleep, sleep, until=until))


def async_retrying(*, attempts: int, base_s: float, max_s: float, retry: retry_base = retry_transient_http,
                   before_sleep: Callable[[RetryCallState], Any] | None = None,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                   throttle: Callable[[RetryCallState], float | None] | None = None,
                   throttle_budget_s: float = math.inf) -> AsyncRetrying:
    """The same policy for coroutines: `await async_retrying(...)(coro_fn, *args)`. One per call
    (its statistics are per object, and concurrent calls on one loop would share them).

    `throttle(retry_state)`: the seconds a failed attempt's throttled answer asks to wait (None when
    it was not throttled); those attempts are waited out and not counted against `attempts`, until
    `throttle_budget_s` of waits is spent (module docstring). `throttle_counts(policy.statistics)`
    says how many and how long so far: after the call, and also after it was cancelled."""
    return AsyncRetrying(**_policy(attempts, retry, base_s, max_s, before_sleep, sleep, throttle, throttle_budget_s))


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` stripped, cut to `limit` characters with "…" when longer: how an error message or
    an attempt log quotes a body."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "…"
