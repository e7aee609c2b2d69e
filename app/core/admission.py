"""Turns at the database for the requests of one API process (docs/operations.md, "Under load").

A request's session runs its queries on threads of the thread pool, one hop per dependency,
endpoint and commit. If more requests held sessions than the pool has connections, the threads
of the ones waiting for a connection could be every thread there is, while the requests that hold
connections wait for a thread to commit on: nothing moves until the pool's timeout, then 500s.

So a request takes a turn before its session opens and gives it back when the session closes.
There are at most as many turns as connections (less those of the background loops): a query
never waits for a connection. A request waits for its turn on the event loop, holding no thread
and no connection, for at most `api_queue_timeout_s`; past it the answer is 503 `server_busy`
with `Retry-After` (the `openai` SDK retries it). A route that then waits on a slow peer (the
inference server, a grader) gives its turn back first (`app.core.deps.done_with_database`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from weakref import WeakKeyDictionary

from app.core.errors import APIError
from app.observability.registry import API_BUSY_REFUSALS


def server_busy(retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(503, f"The server is busy; retry in {seconds} s.", code="server_busy", type="server_error",
                    headers={"Retry-After": str(seconds)})


class DatabaseTurns:
    """At most `capacity` requests use the database at once; the others wait up to `wait_s`."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity, self.wait_s = capacity, wait_s
        # One semaphore per event loop: a semaphore belongs to the loop it first waited on, and tests
        # serve one app from several loops (an API process has one).
        self._turns: WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        turns = self._turns.get(loop)
        if turns is None:
            turns = self._turns[loop] = asyncio.Semaphore(self.capacity)
        return turns

    async def take(self, *, patient: bool = False) -> Callable[[], None]:
        """Wait for a turn (503 `server_busy` when none came within `wait_s`; `patient`: as long as
        it takes, for work after a response, which nobody could be told to retry); returns what
        gives it back, which does so once however often it is called."""
        turns = self._semaphore()
        try:
            async with asyncio.timeout(None if patient else self.wait_s):
                await turns.acquire()
        except TimeoutError:
            API_BUSY_REFUSALS.inc()
            raise server_busy(min(self.wait_s, 5.0)) from None
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                turns.release()

        return give_back
