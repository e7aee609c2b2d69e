"""Trace context on outbound requests (tools, endpoint graders, judges).

A rollout's `trace_id` (`trace_<32 hex>`, workers/engine/rollout.py) maps to a W3C trace id, so the
`traceparent` header of every request of one rollout names the same trace and a customer's
OpenTelemetry traces line up with our rollouts. The worker and the API (the rollout browser)
import this one mapping.
"""

from __future__ import annotations

import hashlib
import re
import secrets

_OUR_TRACE_ID = re.compile(r"^trace_([0-9a-fA-F]{32})$")
_ZERO_TRACE = "0" * 32


def w3c_trace_id(trace_id: str) -> str:
    """32 lowercase hex digits: the hex of `trace_<32 hex>` as it is, any other id hashed.
    Never all zeros (W3C: an invalid trace id)."""
    match = _OUR_TRACE_ID.match(trace_id)
    hex_id = match.group(1).lower() if match else hashlib.sha256(trace_id.encode()).hexdigest()[:32]
    return hex_id if hex_id != _ZERO_TRACE else hashlib.sha256(trace_id.encode()).hexdigest()[:32]


def new_span_id() -> str:
    """16 hex digits, random per request, never all zeros."""
    span = secrets.token_hex(8)
    return span if span != "0" * 16 else "0" * 15 + "1"


def traceparent(trace_id: str, span_id: str | None = None) -> str:
    """`00-<trace id>-<span id>-01` (version 00, sampled)."""
    return f"00-{w3c_trace_id(trace_id)}-{span_id or new_span_id()}-01"


def idempotency_key(trace_id: str, call_id: str) -> str:
    """The same for every attempt of one tool call, different across calls: a hash of both ids
    (64 hex digits), so a server can deduplicate a retried side effect without parsing our ids."""
    return hashlib.sha256(f"{trace_id}\n{call_id}".encode()).hexdigest()
