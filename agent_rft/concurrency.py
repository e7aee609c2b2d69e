"""An adaptive (AIMD) concurrency limit for outbound calls to a customer's endpoint.

At most `limit` requests are in flight at once. A throttled answer (429 or 503) halves the limit
(multiplicative decrease); a round of successes at the current limit (as many as the limit) adds
one (additive increase), never above `max_limit` nor below 1. So a busy endpoint gets fewer
requests at once, and regains its full concurrency once it copes again.

A request that started before the last decrease says nothing about the new limit: its throttled
answer does not halve the limit again, so a burst of 429s from one round of requests halves it
once, not once per request.

Used by the tool client (workers/engine/tools_client.py, one per tool) and the graders' outbound
calls (agent_rft/graders/judges.py, one per URL). Bound to the event loop that first waits on it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from agent_rft.retry import throttle_counts


@dataclass(frozen=True)
class Slot:
    """One request's hold on the limit: the decrease epoch it started in."""

    epoch: int


@dataclass
class Hold:
    """A request in progress under the limit; set `throttled` when its answer was a throttled one."""

    throttled: bool = False


class AdaptiveLimit:
    def __init__(self, max_limit: int) -> None:
        self.max_limit = max(1, max_limit)
        self.limit = self.max_limit
        self.in_flight = 0
        self.throttled = 0  # throttled answers seen
        self._epoch = 0  # bumped at every decrease
        self._successes = 0  # in a row since the last change of the limit
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> Slot:
        while self.in_flight >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                else:
                    self._wake()  # it was woken for a free slot it will not take: pass the slot on
                raise
        self.in_flight += 1
        return Slot(self._epoch)

    @asynccontextmanager
    async def held(self) -> AsyncIterator[Hold]:
        """acquire, then release however the block ends (a cancelled request too, as no sign of
        throttling), saying whether the block marked its answer throttled."""
        slot, hold = await self.acquire(), Hold()
        try:
            yield hold
        finally:
            self.release(slot, throttled=hold.throttled)

    def release(self, slot: Slot, *, throttled: bool = False) -> None:
        """Give the slot back, saying whether its answer was a throttled one. Synchronous, so that
        a cancelled request still gives its slot back."""
        self.in_flight -= 1
        if throttled:
            self._throttled(slot)
        else:
            self._succeeded()
        self._wake()

    def _wake(self) -> None:
        for _ in range(max(0, self.limit - self.in_flight)):
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break

    def _throttled(self, slot: Slot) -> None:
        self.throttled += 1
        self._successes = 0
        if slot.epoch == self._epoch and self.limit > 1:
            self.limit = max(1, self.limit // 2)
            self._epoch += 1

    def _succeeded(self) -> None:
        self._successes += 1
        if self._successes >= self.limit and self.limit < self.max_limit:
            self.limit += 1
            self._successes = 0


@dataclass
class Backpressure:
    """One endpoint's adaptive concurrency and what its throttling cost so far: the answers that
    asked to wait (429/503 with Retry-After, agent_rft.retry) and the seconds waited for them."""

    limit: AdaptiveLimit
    throttled: int = 0
    throttle_wait_s: float = 0.0

    @classmethod
    def up_to(cls, max_concurrency: int) -> Backpressure:
        return cls(AdaptiveLimit(max_concurrency))

    def count(self, statistics: Mapping[str, Any]) -> tuple[int, float]:
        """Add one call's throttled answers and waits (its retry policy's statistics); return them."""
        throttled, waited = throttle_counts(statistics)
        self.throttled += throttled
        self.throttle_wait_s += waited
        return throttled, waited

    def stats(self) -> dict[str, float]:
        return {"throttled": self.throttled, "throttle_wait_s": self.throttle_wait_s,
                "concurrency": self.limit.limit, "max_concurrency": self.limit.max_limit}
