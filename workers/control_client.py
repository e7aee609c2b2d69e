"""The worker's side of the control plane's internal API (docs/internal-api.md).

Workers hold no database credentials: everything they read or report goes through these
calls, authenticated with AGENT_RFT_WORKER_TOKEN. Every push is idempotent on the server, so
a push that failed half-way is simply sent again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import RetryCallState

from app.core.retry import excerpt, retrying

log = logging.getLogger(__name__)


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


_ERRORS = {"lease_held": LeaseHeld, "not_claimable": NotClaimable, "lease_lost": LeaseLost}


@dataclass
class Claim:
    lease_id: str
    lease_expires_at: int
    job: dict[str, Any]


class ControlPlaneClient:
    """Synchronous and thread-safe (httpx.Client): used from the task, the heartbeat thread
    and the trainer's hooks alike."""

    def __init__(self, api_url: str, token: str, *, timeout_s: float = 30.0, attempts: int = 5,
                 backoff_s: float = 0.5, backoff_max_s: float = 8.0) -> None:
        self.http = httpx.Client(base_url=api_url.rstrip("/") + "/internal/v1", timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"})
        self.attempts, self.backoff_s, self.backoff_max_s = attempts, backoff_s, backoff_max_s
        self.lease_id: str | None = None

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Retry what app.core.retry calls transient: connection errors, timeouts, 408, 429 and
        5xx (every internal call is idempotent). Any other 4xx, 409 lease_lost included, is final."""
        policy = retrying(attempts=self.attempts, base_s=self.backoff_s, max_s=self.backoff_max_s,
                          before_sleep=_log_retry)
        return self._checked(policy(self.http.request, method, path, **kwargs))

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

    def _leased(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"lease_id": self.lease_id, **body}

    # --- the job's life -------------------------------------------------------------------
    def claim(self, job_id: str, worker_id: str) -> Claim:
        data = self._request("POST", f"/jobs/{job_id}/claim", json={"worker_id": worker_id}).json()
        self.lease_id = data["lease_id"]
        return Claim(lease_id=data["lease_id"], lease_expires_at=data["lease_expires_at"], job=data["job"])

    def heartbeat(self, job_id: str) -> str:
        return self._request("POST", f"/jobs/{job_id}/heartbeat", json=self._leased({})).json()["action"]

    def file_content(self, file_id: str) -> bytes:
        return self._request("GET", f"/files/{file_id}/content").content

    def file_rows(self, file_id: str) -> list[dict[str, Any]]:
        """A JSONL file's rows (the API validated every line before any worker sees it)."""
        text = self.file_content(file_id).decode("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def push_step(self, job_id: str, step: int, metrics: dict[str, Any]) -> None:
        self._request("PUT", f"/jobs/{job_id}/steps/{step}", json=self._leased({"metrics": metrics}))

    def push_event(self, job_id: str, key: str, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self._request("POST", f"/jobs/{job_id}/events",
                      json=self._leased({"key": key, "level": level, "message": message, "data": data}))

    def push_rollouts(self, job_id: str, step: int, split: str, records: list[dict[str, Any]]) -> None:
        self._request("POST", f"/jobs/{job_id}/rollouts",
                      json=self._leased({"step": step, "split": split, "records": records}))

    def push_checkpoint(self, job_id: str, step: int, path: str, metrics: dict[str, Any]) -> list[str]:
        response = self._request("PUT", f"/jobs/{job_id}/checkpoints/{step}",
                                 json=self._leased({"path": path, "metrics": metrics}))
        return list(response.json().get("delete_paths", []))

    def push_state(self, job_id: str, *, completed_steps: int, resume_state: str,
                   resolved_hyperparameters: dict[str, Any] | None, trained_tokens: int | None) -> None:
        self._request("POST", f"/jobs/{job_id}/state", json=self._leased({
            "completed_steps": completed_steps, "resume_state": resume_state,
            "resolved_hyperparameters": resolved_hyperparameters, "trained_tokens": trained_tokens}))

    def finish(self, job_id: str, status: str, *, error: dict[str, Any] | None = None,
               trained_tokens: int | None = None) -> None:
        self._request("POST", f"/jobs/{job_id}/finish",
                      json=self._leased({"status": status, "error": error, "trained_tokens": trained_tokens}))

    def job_diagnostic(self, job_id: str) -> dict[str, Any]:
        """The variance diagnostic this (leased) job runs before training: {id, status, created}."""
        return self._request("POST", f"/jobs/{job_id}/diagnostic", json=self._leased({})).json()

    # --- a variance diagnostic's life (one client per claim: it holds that claim's lease) ----
    def claim_diagnostic(self, diagnostic_id: str, worker_id: str) -> Claim:
        data = self._request("POST", f"/diagnostics/{diagnostic_id}/claim", json={"worker_id": worker_id}).json()
        self.lease_id = data["lease_id"]
        return Claim(lease_id=data["lease_id"], lease_expires_at=data["lease_expires_at"], job=data["diagnostic"])

    def diagnostic_heartbeat(self, diagnostic_id: str) -> str:
        return self._request("POST", f"/diagnostics/{diagnostic_id}/heartbeat", json=self._leased({})).json()["action"]

    def push_diagnostic_rollouts(self, diagnostic_id: str, records: list[dict[str, Any]], *,
                                 samples_total: int | None = None, load_basis: dict[str, Any] | None = None
                                 ) -> dict[str, Any]:
        return self._request("POST", f"/diagnostics/{diagnostic_id}/rollouts", json=self._leased({
            "records": records, "samples_total": samples_total, "load_basis": load_basis})).json()

    def finish_diagnostic(self, diagnostic_id: str, status: str, *, error: dict[str, Any] | None = None) -> str:
        return self._request("POST", f"/diagnostics/{diagnostic_id}/finish",
                             json=self._leased({"status": status, "error": error})).json()["status"]

    def diagnostic(self, diagnostic_id: str) -> dict[str, Any]:
        """The diagnostic as users see it, results included."""
        return self._request("GET", f"/diagnostics/{diagnostic_id}").json()


def _log_retry(retry_state: RetryCallState) -> None:
    outcome = retry_state.outcome
    if outcome is not None and outcome.failed:
        log.warning("control plane unreachable (%s), retrying", outcome.exception())
    elif outcome is not None:
        log.warning("control plane answered %s, retrying", outcome.result().status_code)


class Heartbeat(threading.Thread):
    """Keeps the lease alive from its own thread (training blocks the event loop for seconds at
    a time) and remembers what the control plane asked for: continue, pause, cancel, or lost."""

    def __init__(self, client: ControlPlaneClient, job_id: str, interval_s: float,
                 call: Callable[[str], str] | None = None) -> None:
        super().__init__(name=f"heartbeat-{job_id}", daemon=True)
        self.client, self.job_id, self.interval_s = client, job_id, interval_s
        self.call = call or client.heartbeat  # client.diagnostic_heartbeat for a diagnostic
        self.action = "continue"
        self._stop_event = threading.Event()

    def beat(self) -> str:
        try:
            self.action = self.call(self.job_id)
        except LeaseLost:
            self.action = "lost"
        except (ControlPlaneError, httpx.TransportError) as exc:
            log.warning("heartbeat for %s failed: %s", self.job_id, exc)
        return self.action

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            if self.beat() == "lost":
                return

    def stop(self) -> None:
        self._stop_event.set()
