"""One HTTP attempt of a webhook delivery, through the SSRF-guarded client (no redirects, every
connection checked). Used by the `deliver_webhook` worker task and by the API's `/test` route;
imports no web framework and no database code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

from agent_rft.urls import BlockedURL, guarded_client

EXCERPT_BYTES = 1024


@dataclass
class AttemptResult:
    status_code: int | None
    latency_ms: int
    response_excerpt: str | None
    error: str | None

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


async def _post(url: str, headers: dict[str, str], body: str, allowlist: Iterable[str],
                timeout_s: float) -> tuple[int, bytes, str | None]:
    async with guarded_client(allowlist, timeout=timeout_s) as client:
        async with client.stream("POST", url, content=body.encode(), headers=headers) as response:
            excerpt = b""
            async for chunk in response.aiter_bytes():
                excerpt += chunk
                if len(excerpt) >= EXCERPT_BYTES:
                    break
            location = response.headers.get("location") if response.is_redirect else None
            return response.status_code, excerpt[:EXCERPT_BYTES], location


async def send_attempt(url: str, headers: dict[str, str], body: str, *, allowlist: Iterable[str],
                       timeout_s: float) -> AttemptResult:
    """POST `body` once; never raises. The whole attempt (connect, send, first KiB of the answer)
    is bounded by `timeout_s`."""
    started = time.monotonic()
    status: int | None = None
    excerpt: str | None = None
    error: str | None = None
    try:
        status, raw, location = await asyncio.wait_for(_post(url, headers, body, allowlist, timeout_s), timeout_s)
        excerpt = raw.decode("utf-8", errors="replace")
        if location is not None:
            error = f"redirect to '{location[:500]}' not followed: webhook URLs must answer themselves"
        elif not 200 <= status < 300:
            error = f"the endpoint answered HTTP {status}"
    except (asyncio.TimeoutError, httpx.TimeoutException):
        error = f"timed out after {timeout_s:g} s"
    except BlockedURL as exc:
        error = f"blocked by the SSRF guard: {exc}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:1000] or type(exc).__name__
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"[:1000]
    latency_ms = int((time.monotonic() - started) * 1000)
    return AttemptResult(status_code=status, latency_ms=latency_ms, response_excerpt=excerpt, error=error)
