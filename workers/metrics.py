"""A worker's Prometheus metrics: where each training step's seconds went, rollouts and tokens,
tool calls and graders. Served on AGENT_RFT_WORKER_METRICS_PORT by prometheus_client's own HTTP
server, started when the Celery worker starts (docs/observability.md).

Celery's solo pool (`agent-rft worker`, concurrency 1) runs tasks in the worker process itself, so
its registry is the one served. The prefork pool (concurrency > 1) records in child processes:
there PROMETHEUS_MULTIPROC_DIR must be set (an empty directory, before the worker starts) and the
server collects every child's files. Importing this module pulls in no torch.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from celery.signals import worker_init, worker_process_shutdown
from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess, start_http_server

from app.core.config import Settings, get_settings

log = logging.getLogger(__name__)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
REGISTRY = CollectorRegistry(auto_describe=True)
# Steps and phases take from milliseconds (a tiny model) to many minutes (large batches).
STEP_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Per-job series of the most recent jobs only, so a long-lived worker's label sets stay bounded.
KEPT_JOBS = 16
UNKNOWN_TOOL = "unknown"  # a name the model made up is not a label value

STEP_PHASE_SECONDS = Histogram(
    "agent_rft_worker_step_phase_seconds", "Seconds of one training step spent in each phase.",
    ["job_id", "phase"], buckets=STEP_BUCKETS, registry=REGISTRY)
ROLLOUTS = Counter("agent_rft_worker_rollouts", "Training rollouts sampled.", ["job_id"], registry=REGISTRY)
COMPLETION_TOKENS = Counter("agent_rft_worker_completion_tokens", "Tokens the policy generated in training rollouts.",
                            ["job_id"], registry=REGISTRY)
TOOL_CALL_SECONDS = Histogram(
    "agent_rft_worker_tool_call_seconds", "Latency of a tool call, retries and waits included.",
    ["tool"], buckets=CALL_BUCKETS, registry=REGISTRY)
TOOL_CALL_ERRORS = Counter("agent_rft_worker_tool_call_errors", "Tool calls that did not succeed, by outcome.",
                           ["tool", "status"], registry=REGISTRY)
GRADER_SECONDS = Histogram("agent_rft_worker_grader_seconds", "Latency of grading one rollout, by grader type.",
                           ["grader"], buckets=CALL_BUCKETS, registry=REGISTRY)
GRADER_ERRORS = Counter("agent_rft_worker_grader_errors", "Gradings that failed, by grader type.",
                        ["grader"], registry=REGISTRY)

_recent_jobs: OrderedDict[str, set[tuple[str, ...]]] = OrderedDict()


def step_phases(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A step's seconds by phase from its metrics event (workers/methods/reinforcement/step_report.py): sampling (the
    model's prefill and decode), tools (the wall time sampling waited, mostly on tool calls),
    grading, update, eval, and the whole step. A supervised step reports its whole time only."""
    timing = metrics.get("timing") or {}
    step, breakdown = timing.get("step") or {}, timing.get("breakdown") or {}
    if not step:
        return {"step": float(timing["step_s"])} if "step_s" in timing else {}
    phases = {"sampling": breakdown.get("prefill", 0.0) + breakdown.get("decode", 0.0),
              "tools": breakdown.get("tool_wait_and_other"), "grading": step.get("grading"),
              "update": step.get("training"), "eval": step.get("eval"), "step": step.get("full_iteration")}
    return {phase: float(seconds) for phase, seconds in phases.items() if seconds is not None}


def _forget_old_jobs(job_id: str) -> None:
    """Keep the per-job series of the KEPT_JOBS most recent jobs; drop older ones' label sets
    (multiprocess mode cannot drop them: they stay until the worker restarts)."""
    _recent_jobs.setdefault(job_id, set())
    _recent_jobs.move_to_end(job_id)
    while len(_recent_jobs) > KEPT_JOBS:
        _, label_sets = _recent_jobs.popitem(last=False)
        for metric, labels in label_sets if not os.environ.get(MULTIPROC_ENV) else ():
            metric.remove(*labels)


def _per_job(metric: Any, job_id: str, *labels: str) -> Any:
    _recent_jobs[job_id].add((metric, (job_id, *labels)))
    return metric.labels(job_id, *labels)


def record_step(job_id: str, metrics: Mapping[str, Any], rollouts: int) -> None:
    """One reported training step: its phases' seconds, its rollouts and generated tokens."""
    _forget_old_jobs(job_id)
    for phase, seconds in step_phases(metrics).items():
        _per_job(STEP_PHASE_SECONDS, job_id, phase).observe(seconds)
    _per_job(ROLLOUTS, job_id).inc(rollouts)
    _per_job(COMPLETION_TOKENS, job_id).inc((metrics.get("usage") or {}).get("completion_tokens") or 0)


def record_tool_call(tool: str, status: str, latency_s: float, *, known: bool) -> None:
    """One tool call's outcome (ToolResult.status); `known`: the tool is configured for the job."""
    name = tool if known else UNKNOWN_TOOL
    if status == "skipped":  # the diagnostic skipped it on purpose: no call, no error
        return
    if known:
        TOOL_CALL_SECONDS.labels(name).observe(latency_s)
    if status != "ok":
        TOOL_CALL_ERRORS.labels(name, status).inc()


def record_grading(grader: str, latency_s: float, *, failed: bool) -> None:
    GRADER_SECONDS.labels(grader).observe(latency_s)
    if failed:
        GRADER_ERRORS.labels(grader).inc()


def served_registry() -> CollectorRegistry:
    """This process's registry, or, under the prefork pool's multiprocess mode, one that collects
    what every child process wrote to PROMETHEUS_MULTIPROC_DIR."""
    if not os.environ.get(MULTIPROC_ENV):
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def serve_metrics(settings: Settings) -> bool:
    """Start the metrics server when AGENT_RFT_WORKER_METRICS_PORT is set; loopback only unless
    AGENT_RFT_METRICS_PUBLIC (prometheus_client's server checks no token)."""
    if settings.worker_metrics_port is None:
        return False
    address = "0.0.0.0" if settings.metrics_public else "127.0.0.1"
    start_http_server(settings.worker_metrics_port, addr=address, registry=served_registry())
    log.info("worker metrics on http://%s:%d/metrics", address, settings.worker_metrics_port)
    return True


@worker_init.connect
def _serve_when_the_worker_starts(**_: Any) -> None:
    serve_metrics(get_settings())


@worker_process_shutdown.connect
def _forget_a_dead_child(pid: int | None = None, **_: Any) -> None:
    if os.environ.get(MULTIPROC_ENV) and pid is not None:  # its live gauges would linger otherwise
        multiprocess.mark_process_dead(pid)
