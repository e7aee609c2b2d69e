"""The inference server's Prometheus metrics (its `GET /metrics`, docs/observability.md): requests
by the HTTP status they were answered with, time to first token, and generation speed."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from workers.inference.backend import Pending

REGISTRY = CollectorRegistry(auto_describe=True)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SPEED_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)

REQUESTS = Counter("agent_rft_inference_requests", "Chat completion requests, by the HTTP status of the answer.",
                   ["status"], registry=REGISTRY)
TIME_TO_FIRST_TOKEN = Histogram(
    "agent_rft_inference_time_to_first_token_seconds",
    "Seconds from a request's arrival to its first generated token (queueing and prefill included).",
    buckets=TTFT_BUCKETS, registry=REGISTRY)
TOKENS_PER_SECOND = Histogram(
    "agent_rft_inference_tokens_per_second", "A request's completion tokens per second of its generation.",
    buckets=SPEED_BUCKETS, registry=REGISTRY)
COMPLETION_TOKENS = Counter("agent_rft_inference_completion_tokens", "Completion tokens generated for requests.",
                            registry=REGISTRY)


def record_request(status_code: int) -> None:
    REQUESTS.labels(str(status_code)).inc()


def record_generation(pending: Pending, completion_tokens: int) -> None:
    """A request's generation is done: its time to first token, when a token was seen (every request on
    the engine backend, streamed ones on vLLM), and its tokens per second from the first token on."""
    done = time.monotonic()
    COMPLETION_TOKENS.inc(completion_tokens)
    first = pending.first_token_at
    if first is None:
        return
    TIME_TO_FIRST_TOKEN.observe(max(0.0, first - pending.received_at))
    if done > first and completion_tokens > 1:  # one token says nothing of speed
        TOKENS_PER_SECOND.observe(completion_tokens / (done - first))


def exposition() -> bytes:
    return generate_latest(REGISTRY)
