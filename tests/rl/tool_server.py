"""A real tool server for tests (docs/tool-server.md), recording every request it receives."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.conftest import serve_app


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.calls.append(entry)

    def max_in_flight(self) -> int:
        """The most requests the server was handling at one moment."""
        edges = sorted([(c["at"], 1) for c in self.calls] + [(c["done"], -1) for c in self.calls])
        current = peak = 0
        for _, step in edges:
            current += step
            peak = max(peak, current)
        return peak


def make_app(recorder: Recorder, *, latency_s: float = 0.0) -> FastAPI:
    app = FastAPI()

    @app.post("/tools")
    async def tools(request: Request):  # noqa: ANN202
        body = await request.json()
        args = json.loads(body["arguments"])
        entry = {"body": body, "headers": dict(request.headers), "at": time.monotonic()}
        recorder.add(entry)
        if latency_s:
            await asyncio.sleep(latency_s)
        query = str(args.get("query", ""))
        if query.startswith("wait "):  # "wait 80": this call takes 80 ms more
            await asyncio.sleep(int(query.split()[1]) / 1000)
        entry["done"] = time.monotonic()
        if body["name"] == "broken":
            return PlainTextResponse("internal error", status_code=500)
        if body["name"] == "search" and args.get("query") == "bad":
            return PlainTextResponse("query too short: use at least 4 characters", status_code=400)
        output = f"{body['name']} result for {json.dumps(args, sort_keys=True)}"
        return JSONResponse({"type": "function_call_output", "call_id": body["call_id"], "output": output})

    return app


@contextmanager
def tool_server(*, latency_s: float = 0.0) -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    with serve_app(make_app(recorder, latency_s=latency_s)) as port:
        yield f"http://127.0.0.1:{port}/tools", recorder
