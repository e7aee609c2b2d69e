"""The worker's side of the control plane's internal API (docs/internal-api.md).

Workers hold no database credentials: everything they read or report goes through these
calls, authenticated with AGENT_RFT_WORKER_TOKEN. Every push is idempotent on the server, so
a push that failed half-way is simply sent again.

The answers are validated here, once, into the worker API's own schemas
(app/jobs/worker_schemas.py, app/diagnostics/worker_schemas.py): the rest of the worker reads
typed objects, not dicts. Every leased call names its lease, so one client serves a job and
the diagnostic it runs before training.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from tenacity import RetryCallState

from pydantic import BaseModel

from agent_rft.retry import excerpt, retryable_status, retrying
from app.core.worker_schemas import HeartbeatResponse
from app.diagnostics.schemas import DiagnosticObject
from app.evals.worker_schemas import OutputItemsResult, RunClaimResponse, RunFinishResult
from app.diagnostics.worker_schemas import DiagnosticClaimResponse, DiagnosticFinishResult, DiagnosticRolloutResult, JobDiagnostic
from app.jobs.worker_schemas import CheckpointResult, ClaimResponse

log = logging.getLogger(__name__)
# A run this worker stopped without reporting an end: the control plane could not be reached (or
# took the run away); its lease expires and the watchdog re-queues it.
GIVEN_BACK = "given_back"


def worker_id() -> str:
    """Who claims: host, process and a random suffix (a claim names its worker in events)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class ControlPlaneError(Exception):
    def __init__(self, status_code: int, code: str | None, message: str) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code, self.code, self.message = status_code, code, message


class LeaseHeld(ControlPlaneError):
    """Another live worker runs the job: try again later."""


class NotClaimable(ControlPlaneError):
    """The job is paused, cancelled or finished: nothing to do."""


class LeaseLost(ControlPlaneError):
    """The lease expired and the job went to another worker: stop touching it."""


class ControlPlaneUnreachable(ControlPlaneError):
    """The control plane did not answer (or answered only 5xx, 408 or 429) for as long as the
    client's patience allows: give the run back rather than fail it. Its lease then expires and
    the watchdog re-queues the run from its last saved state."""


_ERRORS = {"lease_held": LeaseHeld, "not_claimable": NotClaimable, "lease_lost": LeaseLost}


Answer = TypeVar("Answer", bound=BaseModel)


class ControlPlaneClient:
    """Synchronous and thread-safe (httpx.Client): used from the task, the heartbeat thread
    and the trainer's hooks alike."""

    def __init__(self, api_url: str, token: str, *, timeout_s: float = 30.0, attempts: int = 5,
                 backoff_s: float = 0.5, backoff_max_s: float = 8.0, patience_s: float = 0.0) -> None:
        self.http = httpx.Client(base_url=api_url.rstrip("/") + "/internal/v1", timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"})
        self.attempts, self.backoff_s, self.backoff_max_s = attempts, backoff_s, backoff_max_s
        # A restart or deploy of the API must not end a run: a call keeps retrying while the last
        # answer from the control plane is less than `patience_s` old (a worker's lease length:
        # past it, the control plane counts the run as abandoned anyway).
        self.patience_s = patience_s
        self.last_answer_at = time.monotonic()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Retry what agent_rft.retry calls transient: connection errors, timeouts, 408, 429 and
        5xx (every internal call is idempotent), at least `attempts` times and for as long as the
        patience lasts; then ControlPlaneUnreachable. Any other 4xx, 409 lease_lost included, is final."""
        policy = retrying(attempts=self.attempts, base_s=self.backoff_s, max_s=self.backoff_max_s,
                          before_sleep=_log_retry, until=lambda: self.last_answer_at + self.patience_s)
        try:
            response = policy(self.http.request, method, path, **kwargs)
        except (httpx.TransportError, TimeoutError) as exc:
            raise ControlPlaneUnreachable(503, "control_plane_unreachable", f"{type(exc).__name__}: {exc}") from exc
        if retryable_status(response.status_code):
            raise ControlPlaneUnreachable(response.status_code, "control_plane_unreachable",
                                          f"answered {response.status_code}: {excerpt(response.text, 500)}")
        self.last_answer_at = time.monotonic()
        return self._checked(response)

    @staticmethod
    def _checked(response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            error = response.json()["error"]
            code, message = error.get("code"), error.get("message", "")
        except (ValueError, KeyError, TypeError):
            code, message = None, excerpt(response.text, 500)
        raise _ERRORS.get(code or "", ControlPlaneError)(response.status_code, code, message)

    def _answer(self, schema: type[Answer], method: str, path: str, **kwargs: Any) -> Answer:
        return schema.model_validate(self._request(method, path, **kwargs).json())

    # --- the job's life -------------------------------------------------------------------
    def claim(self, job_id: str, worker_id: str) -> ClaimResponse:
        return self._answer(ClaimResponse, "POST", f"/jobs/{job_id}/claim", json={"worker_id": worker_id})

    def heartbeat(self, job_id: str, lease_id: str) -> str:
        return self._answer(HeartbeatResponse, "POST", f"/jobs/{job_id}/heartbeat",
                            json={"lease_id": lease_id}).action

    def file_content(self, file_id: str) -> bytes:
        return self._request("GET", f"/files/{file_id}/content").content

    def file_rows(self, file_id: str) -> list[dict[str, Any]]:
        """A JSONL file's rows (the API validated every line before any worker sees it)."""
        text = self.file_content(file_id).decode("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def push_step(self, job_id: str, lease_id: str, step: int, metrics: dict[str, Any]) -> None:
        self._request("PUT", f"/jobs/{job_id}/steps/{step}", json={"lease_id": lease_id, "metrics": metrics})

    def push_event(self, job_id: str, lease_id: str, key: str, level: str, message: str,
                   data: dict[str, Any] | None = None) -> None:
        self._request("POST", f"/jobs/{job_id}/events",
                      json={"lease_id": lease_id, "key": key, "level": level, "message": message, "data": data})

    def push_rollouts(self, job_id: str, lease_id: str, step: int, split: str, records: list[dict[str, Any]]) -> None:
        self._request("POST", f"/jobs/{job_id}/rollouts",
                      json={"lease_id": lease_id, "step": step, "split": split, "records": records})

    def push_checkpoint(self, job_id: str, lease_id: str, step: int, path: str, metrics: dict[str, Any]) -> list[str]:
        return self._answer(CheckpointResult, "PUT", f"/jobs/{job_id}/checkpoints/{step}",
                            json={"lease_id": lease_id, "path": path, "metrics": metrics}).delete_paths

    def push_state(self, job_id: str, lease_id: str, *, completed_steps: int, resume_state: str,
                   resolved_hyperparameters: dict[str, Any] | None, trained_tokens: int | None) -> None:
        self._request("POST", f"/jobs/{job_id}/state", json={
            "lease_id": lease_id, "completed_steps": completed_steps, "resume_state": resume_state,
            "resolved_hyperparameters": resolved_hyperparameters, "trained_tokens": trained_tokens})

    def finish(self, job_id: str, lease_id: str, status: str, *, error: dict[str, Any] | None = None,
               trained_tokens: int | None = None) -> None:
        self._request("POST", f"/jobs/{job_id}/finish",
                      json={"lease_id": lease_id, "status": status, "error": error, "trained_tokens": trained_tokens})

    def job_diagnostic(self, job_id: str, lease_id: str) -> JobDiagnostic:
        """The variance diagnostic this (leased) job runs before training."""
        return self._answer(JobDiagnostic, "POST", f"/jobs/{job_id}/diagnostic", json={"lease_id": lease_id})

    # --- a variance diagnostic's life -----------------------------------------------------
    def claim_diagnostic(self, diagnostic_id: str, worker_id: str) -> DiagnosticClaimResponse:
        return self._answer(DiagnosticClaimResponse, "POST", f"/diagnostics/{diagnostic_id}/claim",
                            json={"worker_id": worker_id})

    def diagnostic_heartbeat(self, diagnostic_id: str, lease_id: str) -> str:
        return self._answer(HeartbeatResponse, "POST", f"/diagnostics/{diagnostic_id}/heartbeat",
                            json={"lease_id": lease_id}).action

    def push_diagnostic_rollouts(self, diagnostic_id: str, lease_id: str, records: list[dict[str, Any]], *,
                                 samples_total: int | None = None, load_basis: dict[str, Any] | None = None
                                 ) -> DiagnosticRolloutResult:
        return self._answer(DiagnosticRolloutResult, "POST", f"/diagnostics/{diagnostic_id}/rollouts", json={
            "lease_id": lease_id, "records": records, "samples_total": samples_total, "load_basis": load_basis})

    def finish_diagnostic(self, diagnostic_id: str, lease_id: str, status: str, *,
                          error: dict[str, Any] | None = None) -> str:
        return self._answer(DiagnosticFinishResult, "POST", f"/diagnostics/{diagnostic_id}/finish",
                            json={"lease_id": lease_id, "status": status, "error": error}).status

    def diagnostic(self, diagnostic_id: str) -> DiagnosticObject:
        """The diagnostic as users see it, results included."""
        return self._answer(DiagnosticObject, "GET", f"/diagnostics/{diagnostic_id}")


    # --- an eval run's life ----------------------------------------------------------------
    def claim_eval_run(self, run_id: str, worker_id: str) -> RunClaimResponse:
        return self._answer(RunClaimResponse, "POST", f"/eval_runs/{run_id}/claim", json={"worker_id": worker_id})

    def eval_run_heartbeat(self, run_id: str, lease_id: str) -> str:
        return self._answer(HeartbeatResponse, "POST", f"/eval_runs/{run_id}/heartbeat",
                            json={"lease_id": lease_id}).action

    def push_output_items(self, run_id: str, lease_id: str, items: list[dict[str, Any]], *,
                          items_total: int | None = None) -> OutputItemsResult:
        return self._answer(OutputItemsResult, "POST", f"/eval_runs/{run_id}/output_items",
                            json={"lease_id": lease_id, "items": items, "items_total": items_total})

    def finish_eval_run(self, run_id: str, lease_id: str, status: str, *, error: dict[str, Any] | None = None) -> str:
        return self._answer(RunFinishResult, "POST", f"/eval_runs/{run_id}/finish",
                            json={"lease_id": lease_id, "status": status, "error": error}).status

def _log_retry(retry_state: RetryCallState) -> None:
    outcome = retry_state.outcome
    if outcome is not None and outcome.failed:
        log.warning("control plane unreachable (%s), retrying", outcome.exception())
    elif outcome is not None:
        log.warning("control plane answered %s, retrying", outcome.result().status_code)


class Heartbeat(threading.Thread):
    """Keeps the lease alive from its own thread (training blocks the event loop for seconds at
    a time) and remembers what the control plane asked for: continue, pause, cancel, lost, or
    unreachable (no answer for the client's patience)."""

    def __init__(self, client: ControlPlaneClient, run_id: str, lease_id: str, interval_s: float,
                 call: Callable[[str, str], str] | None = None) -> None:
        super().__init__(name=f"heartbeat-{run_id}", daemon=True)
        self.client, self.run_id, self.lease_id, self.interval_s = client, run_id, lease_id, interval_s
        self.call = call or client.heartbeat  # client.diagnostic_heartbeat for a diagnostic
        self.action = "continue"
        self._stop_event = threading.Event()

    def beat(self) -> str:
        try:
            self.action = self.call(self.run_id, self.lease_id)
        except LeaseLost:
            self.action = "lost"
        except ControlPlaneUnreachable as exc:  # a lease's time without an answer: give the run back
            log.warning("heartbeat for %s: %s", self.run_id, exc)
            self.action = "unreachable"
        except ControlPlaneError as exc:
            log.warning("heartbeat for %s failed: %s", self.run_id, exc)
        return self.action

    def go_on(self) -> bool:
        """Beat now: whether the run may go on (False once it was cancelled, paused or lost). After a
        lease's time without an answer, ControlPlaneUnreachable: give the run back."""
        if self.beat() == "unreachable":
            raise ControlPlaneUnreachable(503, "control_plane_unreachable", "no heartbeat answer for a lease's time")
        return self.action == "continue"

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            if self.beat() == "lost":
                return

    def stop(self) -> None:
        self._stop_event.set()


def worker_failure(exc: Exception) -> dict[str, Any]:
    """The error a run reports for an exception nothing named: its type and message."""
    return {"code": "worker_error", "message": f"{type(exc).__name__}: {exc}"[:2000], "param": None}


async def run_under_lease(name: str, heartbeat: Heartbeat, work: Callable[[], Awaitable[str]],
                          finish: Callable[[str, dict[str, Any] | None], Any],
                          failure: Callable[[Exception], dict[str, Any] | None] = lambda exc: None) -> str:
    """What a leased run (a diagnostic, an eval run) does around its `work`: heartbeat while it
    runs; then report its end with `finish(status, error)`. The status is the work's, or
    `failed` with `failure(exc)` (else the exception's type and message, logged) when it raised.
    Returns it, or `lost` (another worker has the run) or `given_back` (the control plane could
    not be reached: no end is reported). Never raises."""
    heartbeat.start()
    error = None
    try:
        status = await work()
    except (ControlPlaneUnreachable, LeaseLost) as exc:
        log.warning("%s given back (%s): it resumes once its lease expires", name, exc)
        return GIVEN_BACK
    except Exception as exc:  # noqa: BLE001 - a run ends with a reason, never a crashed worker
        status, error = "failed", failure(exc)
        if error is None:
            log.exception("%s failed", name)
            error = worker_failure(exc)
    finally:
        heartbeat.stop()
    if heartbeat.action == "lost":
        return "lost"
    try:
        await asyncio.to_thread(finish, status, error)
    except Exception:  # noqa: BLE001 - the watchdog re-queues a run whose worker cannot report
        log.exception("could not report the end of %s", name)
    return status
