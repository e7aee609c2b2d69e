"""OpenTelemetry spans of training runs, off unless configured: a span per job step, per rollout,
per tool call and per grader call, exported over OTLP.

A rollout's span starts a trace of its own whose trace id is the rollout's `trace_id`
(agent_rft/tracing.py maps one to the other), linked to the step that sampled it. Its tool calls
are child spans, and the `traceparent` header a tool server receives names the tool call's span,
so the customer's own tool-server spans join the rollout's trace as its children.

Configured with OpenTelemetry's standard variables: an exporter is installed when
`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (the exporter reads
the rest: headers, protocol, timeouts); `OTEL_SERVICE_NAME` names the service (default
`agent-rft-worker`). Without them, or without the opentelemetry packages, every function here is
a no-op. Tests install an in-memory exporter with `install(provider)`."""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agent_rft.tracing import w3c_trace_id

_TRACER_NAME = "agent-rft"
_provider: Any = None  # the TracerProvider spans go to; None: spans are off
_rollout_trace: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_trace", default=None)
_rollout_spans: dict[str, Any] = {}  # trace_id -> the rollout span's context, for its grader span
_KEPT_ROLLOUT_SPANS = 10_000  # rollouts never graded (tool failures) are forgotten oldest first


def configure_from_environment() -> None:
    """Install an OTLP exporter when OpenTelemetry's endpoint variables say where to send spans."""
    if _provider is not None or not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                     or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME", "agent-rft-worker")
    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=_rollout_ids())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider)


def install(provider: Any) -> None:
    """Send spans to `provider` (a TracerProvider built with `id_generator()`), or None: off."""
    global _provider
    _provider = provider


def id_generator() -> Any:
    """The id generator a provider needs so that a rollout's trace id is its `trace_id`."""
    return _rollout_ids()


def _tracer() -> Any:
    return _provider.get_tracer(_TRACER_NAME) if _provider is not None else None


@contextmanager
def step_span(step: int, total_steps: int) -> Iterator[Any]:
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span("training step", attributes={"agent_rft.step": step,
                                                                   "agent_rft.total_steps": total_steps}) as span:
        yield span


@contextmanager
def rollout_span(trace_id: str, sample_index: int) -> Iterator[Any]:
    """The rollout's span: the root of a trace whose id is the rollout's, linked to the step."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    from opentelemetry import context, trace

    step = trace.get_current_span().get_span_context()
    links = [trace.Link(step)] if step.is_valid else []
    token = _rollout_trace.set(trace_id)
    try:
        span = tracer.start_span("rollout", context=context.Context(), links=links,
                                 attributes={"agent_rft.trace_id": trace_id, "agent_rft.sample_index": sample_index})
    finally:
        _rollout_trace.reset(token)
    _rollout_spans[trace_id] = span.get_span_context()
    while len(_rollout_spans) > _KEPT_ROLLOUT_SPANS:
        _rollout_spans.pop(next(iter(_rollout_spans)))
    with trace.use_span(span, end_on_exit=True):
        yield span


@contextmanager
def tool_call_span(name: str) -> Iterator[Any]:
    """A tool call, a child of the current rollout's span."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(f"tool call {name}", attributes={"agent_rft.tool": name}) as span:
        yield span


def end_tool_call(span: Any, status: str, error: str | None) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("agent_rft.tool_call.status", status)
    if status == "failed":
        span.set_status(Status(StatusCode.ERROR, error or "failed"))


def grader_call_span(trace_id: str, grader_type: str, latency_s: float, failed: bool) -> None:
    """The grading of one rollout, in the rollout's trace, ending now after `latency_s`."""
    tracer = _tracer()
    parent = _rollout_spans.pop(trace_id, None)
    if tracer is None or parent is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    end = time.time_ns()
    span = tracer.start_span("grader call", context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                             start_time=end - int(latency_s * 1e9), attributes={"agent_rft.grader": grader_type})
    if failed:
        span.set_status(Status(StatusCode.ERROR, "grading failed"))
    span.end(end_time=end)


def current_span_id(trace_id: str) -> str | None:
    """The current span's id (16 hex digits) when it belongs to the rollout `trace_id`, for the
    `traceparent` of the requests it makes; None when spans are off."""
    if _provider is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid or format(context.trace_id, "032x") != w3c_trace_id(trace_id):
        return None
    return format(context.span_id, "016x")


def _rollout_ids() -> Any:
    """OpenTelemetry's random ids, except that a rollout's root span takes the rollout's trace id
    (itself random: `trace_<uuid4 hex>`)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class RolloutIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            trace_id = _rollout_trace.get()
            return int(w3c_trace_id(trace_id), 16) if trace_id else super().generate_trace_id()

    return RolloutIds()
