"""Helpers of the webhook tests: a real receiver (an HTTP server on 127.0.0.1 that checks every
request with the `openai` SDK's `client.webhooks.unwrap`, as a user's receiver would, and answers
with scripted status codes), a Celery worker subprocess, and SDK shortcuts."""

from __future__ import annotations

import asyncio
import io
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from app.core.config import Settings
from tests.conftest import agent_rft_worker, jsonl, question_rows, serve_app, wait_for

SDK = openai.OpenAI(api_key="not-used", base_url="http://127.0.0.1:9/v1", max_retries=0)


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    verified: bool
    event: Any = None  # what unwrap returned

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]


@dataclass
class Receiver:
    secret: str | None = None
    statuses: list[int] = field(default_factory=list)  # answered in order, then 200
    block_first: bool = False  # hold the first request until `release` is set
    on_first_request: Callable[[], None] | None = None  # run as soon as the first request arrives
    url: str = ""
    requests: list[Received] = field(default_factory=list)
    got_request: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def verify(self, body: bytes, headers: dict[str, str], secret: str) -> Any:
        """Raises openai.InvalidWebhookSignatureError unless a signature matches `secret`."""
        return SDK.webhooks.unwrap(body, headers, secret=secret)

    async def handle(self, request: Request) -> PlainTextResponse:
        body, headers = await request.body(), dict(request.headers)
        try:
            event, verified = self.verify(body, headers, self.secret or ""), True
        except (openai.InvalidWebhookSignatureError, ValueError):
            event, verified = None, False
        self.requests.append(Received(headers=headers, body=body, verified=verified, event=event))
        if len(self.requests) == 1 and self.on_first_request is not None:
            self.on_first_request()
        self.got_request.set()
        if self.block_first and len(self.requests) == 1:
            while not self.release.is_set():
                await asyncio.sleep(0.05)
        if not verified:
            return PlainTextResponse("bad signature", status_code=400)
        status = self.statuses.pop(0) if self.statuses else 200
        return PlainTextResponse(f"answered {status}", status_code=status)

    def of_type(self, event_type: str) -> list[Received]:
        return [r for r in self.requests if r.verified and r.event.type == event_type]


@contextmanager
def receiver(**options: Any) -> Iterator[Receiver]:
    recv = Receiver(**options)
    app = Starlette(routes=[Route("/hook", recv.handle, methods=["POST"])])
    with serve_app(app) as port:
        recv.url = f"http://127.0.0.1:{port}/hook"
        try:
            yield recv
        finally:
            recv.release.set()  # a held request must end before the server can


AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
STANDARD = ["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]
PAUSED = "x_agent_rft.fine_tuning.job.paused"
CHECKPOINT = "x_agent_rft.fine_tuning.job.checkpoint.created"
WORKER_TOKEN = "webhook-worker-token"


def webhook_settings(settings: Settings, tmp_path: Path) -> Settings:
    settings.webhook_queue = f"test-webhooks-{uuid.uuid4().hex[:8]}"
    settings.webhook_sweep_interval_s = 0.2
    settings.webhook_timeout_s = 3.0
    settings.webhook_retry_schedule_s = [0.3, 0.3]  # three attempts in all
    settings.worker_token = type(settings.worker_token)(WORKER_TOKEN)
    settings.checkpoint_dir = tmp_path / "checkpoints"
    settings.lease_seconds = 4
    settings.watchdog_interval_s = 0.5
    return settings


def celery_worker(settings: Settings, api_url: str, queues: str):  # noqa: ANN201
    return agent_rft_worker(settings, api_url, token=WORKER_TOKEN, queues=queues)


def queued_job(sdk: openai.OpenAI, rows: list[dict] | None = None) -> str:
    content = io.BytesIO(jsonl(rows or question_rows(tools=False)))
    uploaded = sdk.files.create(file=("train.jsonl", content), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(
        model="SmolLM2-135M-Instruct", training_file=uploaded.id,
        method={"type": "reinforcement", "reinforcement": {"grader": {
            "type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}", "operation": "eq"}}})
    wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id).status in ("queued", "failed"))
    return job.id


def deliveries(sdk: openai.OpenAI, endpoint_id: str) -> list[dict]:
    return sdk.get(f"/webhook_endpoints/{endpoint_id}/deliveries", cast_to=object,
                   options={"params": {"limit": 100}})["data"]


def attempts(sdk: openai.OpenAI, endpoint_id: str, delivery_id: str) -> list[dict]:
    return sdk.get(f"/webhook_endpoints/{endpoint_id}/deliveries/{delivery_id}/attempts", cast_to=object)["data"]


def endpoint_for(sdk: openai.OpenAI, recv: Receiver, event_types: list[str]) -> str:
    created = sdk.webhooks.create(name="receiver", url=recv.url, event_types=event_types)
    recv.secret = created.signing_secret
    return created.id


def settled(sdk: openai.OpenAI, endpoint_id: str, count: int) -> list[dict]:
    def done() -> list[dict] | None:
        rows = deliveries(sdk, endpoint_id)
        return rows if len(rows) == count and all(d["status"] != "pending" for d in rows) else None
    return wait_for(done, timeout=60, interval=0.2)
