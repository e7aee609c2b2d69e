"""A full inference queue answers 429 `rate_limit_exceeded` with `Retry-After` at once, directly and
through the API (streaming too, before any stream starts), and the requests it admitted complete.

The inference server runs in this process (the tiny model), so that the test can hold its one
generation thread busy: the first request is then taken into a batch that cannot start, the second
waits, and with AGENT_RFT_INFERENCE_MAX_QUEUE=1 the third finds the queue full. No timing is guessed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

from app.core.config import Settings
from tests.conftest import live_server, serve_app, wait_for
from workers.inference.engine_backend import EngineBackend
from workers.inference.server import create_inference_app

TINY = "tiny-smollm2"
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = {"model": TINY, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[Settings, EngineBackend]]:
    """The settings with a real inference server (queue bound 1) at `inference_url`, and its backend."""
    settings = settings.model_copy(update={"inference_models": [TINY], "inference_max_queue": 1})
    app = create_inference_app(settings)
    with serve_app(app) as port:
        yield settings.model_copy(update={"inference_url": f"http://127.0.0.1:{port}"}), app.state.backend


@contextmanager
def generation_held(backend: EngineBackend) -> Iterator[None]:
    """The generation thread (a single worker) runs a wait until the block ends: batches queue behind it."""
    release = threading.Event()
    backend.executor.submit(release.wait)
    try:
        yield
    finally:
        release.set()


def queue_state(inference_url: str) -> dict[str, int]:
    return httpx.get(f"{inference_url}/healthz", timeout=10).json()["queue"]


def fill_queue(threads: ThreadPoolExecutor, inference_url: str, send: Callable[[], httpx.Response]) -> list[Future]:
    """One request taken into the (held) batch, then one waiting: the queue of 1 is full."""
    admitted = [threads.submit(send)]
    wait_for(lambda: queue_state(inference_url) == {"waiting": 0, "generating": 1, "max_waiting": 1})
    admitted.append(threads.submit(send))
    wait_for(lambda: queue_state(inference_url)["waiting"] == 1)
    return admitted


def assert_queue_full(answer: httpx.Response) -> None:
    assert answer.status_code == 429, answer.text
    assert answer.headers["content-type"] == "application/json"  # an error, not a stream
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert (error["code"], error["type"], error["param"]) == ("rate_limit_exceeded", "requests", None)
    assert "capacity" in error["message"] and f"{answer.headers['retry-after']} s" in error["message"]


def assert_completed(admitted: list[Future]) -> None:
    for future in admitted:
        answer = future.result(timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_full_queue_is_a_429_from_the_inference_server(served):
    settings, backend = served
    url = f"{settings.inference_url}/internal/v1/chat/completions"
    headers = {"Authorization": f"Bearer {settings.worker_token.get_secret_value()}"}
    model = {"name": TINY, "base": TINY, "checkpoint_path": None}

    def send(**fields) -> httpx.Response:  # noqa: ANN003
        return httpx.post(url, json={"request": {**CHAT, **fields}, "model": model}, headers=headers, timeout=120)

    with ThreadPoolExecutor(2) as threads:
        with generation_held(backend):
            admitted = fill_queue(threads, settings.inference_url, send)
            assert_queue_full(send())
            assert_queue_full(send(stream=True))
            assert queue_state(settings.inference_url)["waiting"] == 1  # the refused ones left nothing behind
        assert_completed(admitted)
    assert queue_state(settings.inference_url) == {"waiting": 0, "generating": 0, "max_waiting": 1}


def test_the_api_passes_the_429_and_its_retry_after_through(served, project):
    settings, backend = served
    with live_server(settings) as api_url:
        headers = {"Authorization": f"Bearer {project['key']}"}

        def send(**fields) -> httpx.Response:  # noqa: ANN003
            return httpx.post(f"{api_url}/v1/chat/completions", json={**CHAT, **fields}, headers=headers, timeout=120)

        sdk = openai.OpenAI(base_url=f"{api_url}/v1", api_key=project["key"], max_retries=0, timeout=30)
        with ThreadPoolExecutor(2) as threads:
            with generation_held(backend):
                admitted = fill_queue(threads, settings.inference_url, send)
                assert_queue_full(send())
                assert_queue_full(send(stream=True))
                with pytest.raises(openai.RateLimitError) as refused:  # what an SDK user sees
                    sdk.chat.completions.create(**CHAT, stream=True)
                assert refused.value.code == "rate_limit_exceeded"
                assert int(refused.value.response.headers["retry-after"]) >= 1
            assert_completed(admitted)


def test_the_queue_bound_is_at_least_one():
    with pytest.raises(ValueError, match="inference_max_queue"):
        Settings(_env_file=None, inference_max_queue=0)
