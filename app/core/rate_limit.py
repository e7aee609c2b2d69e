"""The per-key request rate limit on `/v1` (AGENT_RFT_API_RATE_LIMIT, e.g. `600/minute`), with
the `limits` library's moving window: a key over its limit is answered 429 in OpenAI's error
shape with `Retry-After`, the seconds until the window lets one more request through.

The counts live in `AGENT_RFT_API_RATE_LIMIT_STORAGE`: `memory://` (default) counts per API
process; a `redis://` URL shares one count across every API process.
"""

from __future__ import annotations

import math
import time

from limits import parse, storage, strategies

from app.core.errors import APIError


class KeyRateLimiter:
    def __init__(self, limit: str, storage_uri: str = "memory://") -> None:
        self.item = parse(limit)
        self.window = strategies.MovingWindowRateLimiter(storage.storage_from_string(storage_uri))

    def check(self, key_id: str) -> None:
        """Count one request of `key_id`; raise the 429 when it is over its limit."""
        if self.window.hit(self.item, key_id):
            return
        reset = self.window.get_window_stats(self.item, key_id).reset_time
        retry_after = max(1, math.ceil(reset - time.time()))
        raise APIError(
            429, f"Rate limit reached for this API key ({self.item}). Try again in {retry_after} s.",
            code="rate_limit_exceeded", type="requests", headers={"Retry-After": str(retry_after)},
        )
