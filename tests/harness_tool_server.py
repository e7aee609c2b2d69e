"""A tool server written the way OpenAI's Agent RFT example server is (its public contract): one
route per tool, a bearer token, `arguments` as a JSON string, the reply `{"output", "call_id", "id"}`;
and a customer's endpoint grader at `/grade`. It records every request it receives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from tests.conftest import serve_app

TOKEN = "tool-bearer-token"
REPORTS = {"acme": "ACME revenue 2023 was 412 million", "globex": "Globex revenue 2023 was 97 million"}


@dataclass
class Received:
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"path", "headers", "body"}


def make_app(received: Received) -> FastAPI:
    app = FastAPI()

    async def arguments_of(request: Request) -> tuple[dict[str, Any], dict[str, Any]]:
        body = await request.json()
        received.calls.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            raise HTTPException(status_code=401, detail="Invalid bearer token")
        raw = body.get("arguments")
        if not isinstance(raw, str):
            raise HTTPException(status_code=400, detail="'arguments' must be a JSON string")
        return body, json.loads(raw)

    def reply(body: dict[str, Any], output: Any) -> dict[str, Any]:
        return {"output": json.dumps(output), "call_id": body.get("call_id"), "id": body.get("id")}

    @app.post("/search")
    async def search(request: Request) -> dict[str, Any]:
        body, args = await arguments_of(request)
        query = str(args.get("query", "")).lower()
        if query.startswith("sleep "):
            await asyncio.sleep(float(query.split()[1]))
        found = next((text for name, text in REPORTS.items() if name in query), "no report found")
        return reply(body, {"document": found})

    @app.post("/list")
    async def list_reports(request: Request) -> dict[str, Any]:
        body, _ = await arguments_of(request)
        return reply(body, {"entries": sorted(REPORTS)})

    @app.post("/grade")
    async def grade(request: Request) -> dict[str, Any]:
        """A customer's endpoint grader: 1 when the answer names the reference figure, else 0."""
        body = await request.json()
        received.calls.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        answer = str(body["sample"].get("output_text") or "")
        return {"score": 1.0 if str(body["item"].get("reference_answer", "")) in answer else 0.0}

    return app


@contextmanager
def harness_tool_server() -> Iterator[tuple[str, Received]]:
    """Yields (its base URL, what it received)."""
    received = Received()
    with serve_app(make_app(received)) as port:
        yield f"http://127.0.0.1:{port}", received
