"""The one retry policy (agent_rft/retry.py), and the worker's control-plane client
(workers/control_client.py) that follows it, against a real HTTP server on 127.0.0.1 whose
answers each test scripts."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from tenacity import retry_if_exception_type

from agent_rft.retry import (
    RETRYABLE_STATUS,
    Backoff,
    async_retrying,
    excerpt,
    retryable_error,
    retryable_status,
    retrying,
)
from tests.conftest import free_port, serve_app
from workers.control_client import ControlPlaneClient, ControlPlaneError, ControlPlaneUnreachable, LeaseLost

# --- what is transient ---------------------------------------------------------------------------


def test_retryable_answers_are_408_429_and_every_5xx() -> None:
    assert RETRYABLE_STATUS == {408, 429} | set(range(500, 600))
    assert all(retryable_status(code) for code in (408, 429, 500, 501, 503, 504, 599))
    assert not any(retryable_status(code) for code in (200, 204, 301, 302, 400, 401, 404, 409, 410, 413, 422))


def test_retryable_errors_are_transport_errors_and_timeouts() -> None:
    request = httpx.Request("GET", "http://127.0.0.1/")
    for exc in (httpx.ConnectError("refused", request=request), httpx.ReadTimeout("slow", request=request),
                httpx.RemoteProtocolError("cut", request=request), TimeoutError()):
        assert retryable_error(exc), exc
    for exc in (ValueError("bad"), httpx.HTTPStatusError("500", request=request,
                                                         response=httpx.Response(500, request=request))):
        assert not retryable_error(exc), exc


def test_backoff_doubles_up_to_its_cap_with_equal_jitter() -> None:
    backoff = Backoff(base_s=0.5, max_s=8.0)
    for retry_number, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (6, 8.0), (12, 8.0)]:
        delays = [backoff.delay(retry_number) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (retry_number, min(delays), max(delays))
        assert len(set(delays)) > 1  # jittered


def test_excerpt_strips_and_cuts_with_an_ellipsis() -> None:
    assert excerpt("  short answer \n") == "short answer"
    assert excerpt("x" * 300) == "x" * 300
    assert excerpt("x" * 301) == "x" * 300 + "…"
    assert excerpt("abcdef", 3) == "abc…"


# --- the tenacity policies -------------------------------------------------------------------------


def _answers(*statuses: int) -> Any:
    """A function answering httpx.Responses with these statuses in turn; its calls are counted."""
    queue = deque(statuses)
    calls: list[int] = []

    def answer() -> httpx.Response:
        calls.append(1)
        return httpx.Response(queue.popleft() if queue else 200)

    answer.calls = calls  # type: ignore[attr-defined]
    return answer


def test_sync_policy_retries_transient_answers_and_returns_the_first_final_one() -> None:
    slept: list[float] = []
    answer = _answers(503, 429, 408, 200)
    policy = retrying(attempts=5, base_s=0.5, max_s=8.0, sleep=slept.append)
    assert policy(answer).status_code == 200
    assert len(answer.calls) == 4 and policy.statistics["attempt_number"] == 4
    assert len(slept) == 3 and 0.25 <= slept[0] <= 0.5 and 0.5 <= slept[1] <= 1.0 and 1.0 <= slept[2] <= 2.0


def test_sync_policy_does_not_retry_a_final_answer() -> None:
    slept: list[float] = []
    answer = _answers(409, 200)
    assert retrying(attempts=5, base_s=0.5, max_s=8.0, sleep=slept.append)(answer).status_code == 409
    assert len(answer.calls) == 1 and slept == []


def test_after_the_last_attempt_its_answer_or_its_exception_stands() -> None:
    answer = _answers(500, 502, 503, 200)
    policy = retrying(attempts=3, base_s=0.5, max_s=8.0, sleep=lambda s: None)
    assert policy(answer).status_code == 503  # returned as it is, not wrapped in a RetryError
    assert policy.statistics["attempt_number"] == 3

    request = httpx.Request("GET", "http://127.0.0.1/")
    errors = deque([httpx.ConnectError("first", request=request), httpx.ConnectError("last", request=request)])

    def unreachable() -> httpx.Response:
        raise errors.popleft()

    with pytest.raises(httpx.ConnectError, match="last"):
        retrying(attempts=2, base_s=0.5, max_s=8.0, sleep=lambda s: None)(unreachable)


def test_an_error_that_is_not_transient_is_raised_at_once() -> None:
    calls: list[int] = []

    def broken() -> httpx.Response:
        calls.append(1)
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        retrying(attempts=5, base_s=0.5, max_s=8.0, sleep=lambda s: None)(broken)
    assert calls == [1]


def test_async_policy_with_its_own_retry_condition_and_injected_sleep() -> None:
    class Busy(Exception):
        pass

    slept: list[float] = []
    outcomes = deque([Busy(), Busy(), "done"])

    async def attempt() -> str:
        outcome = outcomes.popleft()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def record(seconds: float) -> None:
        slept.append(seconds)

    async def go() -> tuple[str, int]:
        policy = async_retrying(attempts=4, base_s=0.1, max_s=0.15, retry=retry_if_exception_type(Busy), sleep=record)
        return await policy(attempt), policy.statistics["attempt_number"]

    assert asyncio.run(go()) == ("done", 3)
    assert len(slept) == 2 and 0.05 <= slept[0] <= 0.1 and 0.075 <= slept[1] <= 0.15  # capped at max_s


# --- the control-plane client ------------------------------------------------------------------------


class ControlPlane:
    """Stands in for the control plane's internal API: answers what the test scripted, in order
    (then 200 {"action": "continue"}), and records every request's path."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.script: deque[tuple[int, Any]] = deque()
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.add_api_route("/internal/v1/{path:path}", self._answer, methods=["GET", "POST", "PUT"])

    async def _answer(self, path: str, request: Request):  # noqa: ANN202
        with self.lock:
            self.paths.append("/" + path)
            status, body = self.script.popleft() if self.script else (200, {"action": "continue", "lease_expires_at": 1})
        if isinstance(body, str):
            return PlainTextResponse(body, status_code=status)
        return JSONResponse(body, status_code=status)


@pytest.fixture(scope="module")
def running_control_plane() -> Iterator[tuple[ControlPlane, int]]:
    plane = ControlPlane()
    with serve_app(plane.app) as port:
        yield plane, port


@pytest.fixture
def control_plane(running_control_plane: tuple[ControlPlane, int]) -> Iterator[tuple[ControlPlane, ControlPlaneClient]]:
    plane, port = running_control_plane
    plane.paths.clear()
    plane.script.clear()
    client = ControlPlaneClient(f"http://127.0.0.1:{port}", "worker-token", timeout_s=5, attempts=4,
                                backoff_s=0.01, backoff_max_s=0.02)
    yield plane, client
    client.close()


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def test_control_client_retries_5xx_until_the_control_plane_answers(control_plane, caplog) -> None:  # noqa: ANN001
    plane, client = control_plane
    plane.script.extend([(503, "restarting"), (502, "bad gateway"),
                         (200, {"action": "pause", "lease_expires_at": 1})])
    with caplog.at_level(logging.WARNING, logger="workers.control_client"):
        assert client.heartbeat("ftjob-1", "lease_1") == "pause"
    assert plane.paths == ["/jobs/ftjob-1/heartbeat"] * 3
    assert [r.getMessage() for r in caplog.records] == ["control plane answered 503, retrying",
                                                        "control plane answered 502, retrying"]


def test_control_client_retries_408_and_429_like_every_transient_answer(control_plane) -> None:  # noqa: ANN001
    plane, client = control_plane
    plane.script.extend([(429, "slow down"), (408, "request timeout"),
                         (200, {"action": "continue", "lease_expires_at": 1})])
    assert client.heartbeat("ftjob-1", "lease_1") == "continue"
    assert len(plane.paths) == 3


def test_control_client_gives_up_after_its_attempts_with_the_last_answer(control_plane) -> None:  # noqa: ANN001
    plane, client = control_plane
    plane.script.extend([(500, "down")] * 3 + [(503, "still down " + "x" * 600)])
    with pytest.raises(ControlPlaneUnreachable) as raised:
        client.heartbeat("ftjob-1", "lease_1")
    assert raised.value.status_code == 503 and raised.value.code == "control_plane_unreachable"
    assert raised.value.message.startswith("answered 503: still down") and raised.value.message.endswith("…")
    assert len(plane.paths) == 4  # `attempts` in all (no patience)


def test_control_client_waits_out_an_outage_shorter_than_its_patience(control_plane) -> None:  # noqa: ANN001
    """A restarting API answers 503 (or nothing) for a while: with patience, the call goes on past
    its `attempts` and succeeds when the API is back."""
    plane, client = control_plane
    client.patience_s = 30.0
    plane.script.extend([(503, "restarting")] * 12 + [(200, {"action": "continue", "lease_expires_at": 1})])
    assert client.heartbeat("ftjob-1", "lease_1") == "continue"
    assert len(plane.paths) == 13  # 4 attempts would have given up


def test_control_client_4xx_is_final_and_lease_lost_is_raised_at_once(control_plane) -> None:  # noqa: ANN001
    plane, client = control_plane
    plane.script.append((409, _error("lease_lost", "the lease expired")))
    with pytest.raises(LeaseLost, match="the lease expired"):
        client.push_step("ftjob-1", "lease_1", 3, {"loss": 0.5})
    assert plane.paths == ["/jobs/ftjob-1/steps/3"]

    plane.paths.clear()
    plane.script.append((404, _error("file_not_found", "no such file")))
    with pytest.raises(ControlPlaneError) as raised:
        client.file_content("file-1")
    assert (raised.value.status_code, raised.value.code) == (404, "file_not_found")
    assert plane.paths == ["/files/file-1/content"]


def test_control_client_retries_an_unreachable_control_plane_then_raises(caplog) -> None:  # noqa: ANN001
    client = ControlPlaneClient(f"http://127.0.0.1:{free_port()}", "worker-token", timeout_s=2, attempts=3,
                                backoff_s=0.01, backoff_max_s=0.02)
    try:
        with caplog.at_level(logging.WARNING, logger="workers.control_client"), \
                pytest.raises(ControlPlaneUnreachable, match="ConnectError") as raised:
            client.heartbeat("ftjob-1", "lease_1")
    finally:
        client.close()
    assert isinstance(raised.value.__cause__, httpx.ConnectError)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all(m.startswith("control plane unreachable (") for m in messages)


def test_control_client_patience_counts_from_the_last_answer_it_got() -> None:
    """Past `patience_s` since the control plane last answered, a call gives up after its attempts:
    the lease it holds has run out by then, and the worker gives the run back."""
    client = ControlPlaneClient(f"http://127.0.0.1:{free_port()}", "worker-token", timeout_s=2, attempts=2,
                                backoff_s=0.05, backoff_max_s=0.1, patience_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(ControlPlaneUnreachable):
            client.heartbeat("ftjob-1", "lease_1")
        assert 1.0 <= time.monotonic() - started < 10  # it kept trying for its patience
        started = time.monotonic()
        with pytest.raises(ControlPlaneUnreachable):
            client.heartbeat("ftjob-1", "lease_1")  # no answer since: no more patience, `attempts` only
        assert time.monotonic() - started < 1.0
    finally:
        client.close()
