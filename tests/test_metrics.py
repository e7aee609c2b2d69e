"""Prometheus metrics (docs/observability.md): the API's `/metrics` after a real job ran end to end,
the worker's metrics port during it, who may scrape, and the inference server's `/metrics`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta

import httpx
import openai
import pytest
from pydantic import SecretStr
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.core.config import Settings
from app.core.db import utcnow
from app.jobs.watchdog import expire_job_leases
from app.main import create_app
from app.observability.access import is_loopback
from tests.conftest import free_port, live_server, serve_app, wait_for
from tests.rl.tool_server import tool_server
from tests.test_internal import Worker, queued_job
from tests.test_training_e2e import celery_worker, create_job, status_of, training_settings  # noqa: F401
from workers.inference.server import create_inference_app
from workers.metrics import REGISTRY as WORKER_REGISTRY
from workers.engine.tools_client import ToolClient, ToolClientOptions

LOOPBACK = ("127.0.0.1", 50000)
ELSEWHERE = ("203.0.113.7", 50000)  # TEST-NET-3: never this machine
TINY = "tiny-smollm2"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape, by (name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scrape: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float | None:
    return scrape.get((name, frozenset(labels.items())))


def family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_a_job_run_end_to_end_shows_in_the_api_and_worker_metrics(training_settings, project,  # noqa: F811
                                                                  monkeypatch):
    port = free_port()
    monkeypatch.setenv("AGENT_RFT_WORKER_METRICS_PORT", str(port))  # the worker subprocess inherits it
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log):
        job_id = create_job(sdk, tool_url)
        wait_for(lambda: status_of(sdk, job_id) in ("succeeded", "failed"), timeout=240, interval=0.5)
        assert status_of(sdk, job_id) == "succeeded", log.read_text()[-3000:]
        api_text = httpx.get(f"{base}/metrics", timeout=10).text  # a loopback client, no token set
        worker_answer = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        rollouts = sdk.get(f"/fine_tuning/jobs/{job_id}/rollouts", cast_to=object,
                           options={"params": {"limit": 100}})["data"]

    api = samples(api_text)
    assert value(api, "agent_rft_jobs", status="succeeded") == 1
    assert value(api, "agent_rft_jobs", status="running") == 0  # every status has its series
    assert value(api, "agent_rft_queue_depth") == 0 and value(api, "agent_rft_queue_oldest_age_seconds") == 0
    assert value(api, "agent_rft_webhook_outbox_pending") == 0
    assert value(api, "agent_rft_webhook_outbox_lag_seconds") == 0
    assert {"agent_rft_lease_expiries", "agent_rft_webhook_delivery_failures"} <= family_names(api_text)

    assert worker_answer.status_code == 200, log.read_text()[-2000:]
    worker = samples(worker_answer.text)
    for phase in ("sampling", "tools", "grading", "update", "eval", "step"):  # 2 steps, each phase timed
        assert value(worker, "agent_rft_worker_step_phase_seconds_count", job_id=job_id, phase=phase) == 2, phase
    assert value(worker, "agent_rft_worker_rollouts_total", job_id=job_id) == 2 * 2 * 2  # steps x batch x group
    assert value(worker, "agent_rft_worker_completion_tokens_total", job_id=job_id) > 0
    assert value(worker, "agent_rft_worker_grader_seconds_count", grader="text_similarity") >= 8
    # The tiny random model calls `search` when it happens to write a tool call: the worker counted
    # each call the job's rollouts record.
    searches = sum(1 for r in rollouts for call in r["data"]["tool_calls"] if call["name"] == "search")
    assert (value(worker, "agent_rft_worker_tool_call_seconds_count", tool="search") or 0) == searches
    assert "agent_rft_worker_tool_call_seconds" in family_names(worker_answer.text)


def test_tool_calls_are_timed_per_tool_and_their_errors_counted():
    """The tool client records every call: latency by tool, errors by tool and outcome; a tool name
    the model made up is counted as `unknown`, never as a label of its own."""
    before = samples_of_registry()
    with tool_server() as (tool_url, _):
        async def calls() -> None:
            async with ToolClient([{"name": "search", "server_url": tool_url}], allowlist=["127.0.0.1"],
                                  options=ToolClientOptions(connect_timeout_s=2, read_timeout_s=5)) as client:
                await client.call(trace_id="t", call_id="c1", name="search", arguments_json='{"query": "acme"}', item={})
                await client.call(trace_id="t", call_id="c2", name="search", arguments_json='{"query": "bad"}', item={})
                await client.call(trace_id="t", call_id="c3", name="made-up-1", arguments_json="{}", item={})

        asyncio.run(calls())
    after = samples_of_registry()

    def grew(name: str, **labels: str) -> float:
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert grew("agent_rft_worker_tool_call_seconds_count", tool="search") == 2
    assert grew("agent_rft_worker_tool_call_seconds_sum", tool="search") > 0
    assert grew("agent_rft_worker_tool_call_errors_total", tool="search", status="client_error") == 1
    assert grew("agent_rft_worker_tool_call_errors_total", tool="unknown", status="unknown_tool") == 1
    assert not any(("made-up-1" in dict(labels).values()) for _, labels in after)


def samples_of_registry() -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for family in WORKER_REGISTRY.collect() for s in family.samples}


@pytest.fixture
def scraper(app) -> TestClient:  # noqa: ANN001
    """The app as a loopback client sees it (no lifespan: the conftest `client` runs that)."""
    return TestClient(app, client=LOOPBACK)


def test_queue_depth_age_and_lease_expiries(api, app, scraper, settings):
    job_id = queued_job(api)
    scrape = samples(scraper.get("/metrics").text)
    assert value(scrape, "agent_rft_queue_depth") == 1 and value(scrape, "agent_rft_jobs", status="queued") == 1
    assert value(scrape, "agent_rft_queue_oldest_age_seconds") >= 0
    expiries = value(scrape, "agent_rft_lease_expiries_total")

    Worker(scraper, settings.worker_token.get_secret_value()).claim(job_id)
    later = utcnow() + timedelta(seconds=settings.lease_seconds + 1)
    assert expire_job_leases(app.state.session_factory, app.state.queue, now=later) == [job_id]
    scrape = samples(scraper.get("/metrics").text)
    assert value(scrape, "agent_rft_lease_expiries_total") == expiries + 1
    assert value(scrape, "agent_rft_jobs", status="queued") == 1 and value(scrape, "agent_rft_jobs", status="running") == 0


@pytest.mark.parametrize("client_host", [LOOPBACK, ELSEWHERE])
def test_with_a_token_metrics_needs_it_from_every_client(settings, client_host):
    app = create_app(settings.model_copy(update={"metrics_token": SecretStr("scrape-secret")}))
    client = TestClient(app, client=client_host)
    missing = client.get("/metrics")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_metrics_token"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    allowed = client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
    assert allowed.status_code == 200 and allowed.headers["content-type"].startswith("text/plain")
    assert "agent_rft_jobs" in family_names(allowed.text)


def test_without_a_token_metrics_answers_loopback_clients_only_unless_public(settings):
    closed = create_app(settings)
    refused = TestClient(closed, client=ELSEWHERE).get("/metrics")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "metrics_forbidden"
    assert TestClient(closed, client=LOOPBACK).get("/metrics").status_code == 200
    assert TestClient(closed, client=("::1", 50000)).get("/metrics").status_code == 200
    public = create_app(settings.model_copy(update={"metrics_public": True}))
    assert TestClient(public, client=ELSEWHERE).get("/metrics").status_code == 200


def test_loopback_is_the_address_not_a_name():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("localhost") and not is_loopback("testclient") and not is_loopback(None)
    assert not is_loopback("10.0.0.1")


@pytest.fixture
def inference_url(settings: Settings) -> Iterator[tuple[str, str]]:
    """A real inference server with the tiny model, in this process; yields (its URL, the worker token)."""
    settings = settings.model_copy(update={"inference_models": [TINY]})
    with serve_app(create_inference_app(settings)) as port:
        yield f"http://127.0.0.1:{port}", settings.worker_token.get_secret_value()


def test_the_inference_server_counts_requests_and_times_the_first_token(inference_url):
    """Its metrics live in the process (other tests' servers may have counted before): compared
    before and after."""
    url, token = inference_url
    headers = {"Authorization": f"Bearer {token}"}
    body = {"request": {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                        "temperature": 0}, "model": {"name": TINY, "base": TINY, "checkpoint_path": None}}
    chat = f"{url}/internal/v1/chat/completions"
    before = samples(httpx.get(f"{url}/metrics", timeout=10).text)
    answer = httpx.post(chat, json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    streamed = httpx.post(chat, json={**body, "request": {**body["request"], "stream": True}}, headers=headers,
                          timeout=120)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")
    assert httpx.post(chat, json={"request": 1}, headers=headers, timeout=30).status_code == 400
    after = samples(httpx.get(f"{url}/metrics", timeout=10).text)

    def grew(name: str, **labels: str) -> float:
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert grew("agent_rft_inference_requests_total", status="200") == 2
    assert grew("agent_rft_inference_requests_total", status="400") == 1
    assert grew("agent_rft_inference_time_to_first_token_seconds_count") == 2
    assert grew("agent_rft_inference_time_to_first_token_seconds_sum") > 0
    tokens = answer.json()["usage"]["completion_tokens"]
    assert grew("agent_rft_inference_completion_tokens_total") >= tokens > 0
    assert grew("agent_rft_inference_tokens_per_second_count") >= (1 if tokens > 1 else 0)


def test_the_inference_servers_metrics_are_protected_like_the_apis(settings):
    settings = settings.model_copy(update={"inference_models": [TINY], "metrics_token": SecretStr("scrape-secret")})
    client = TestClient(create_inference_app(settings, preload=False), client=LOOPBACK)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"}).status_code == 200
