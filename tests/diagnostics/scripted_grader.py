"""A real endpoint grader (docs/grader-endpoint.md) whose score is scripted by the item: `kind` always0
scores 0, always1 scores 1, mixed alternates 1, 0, 1, … per item `id` (so any two runs of a
mixed sample differ). With `hold_from`, gradings of items whose `id` is at least that wait
until `release` is set: a test can stop a run at a known point."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request

from tests.conftest import serve_app


class Script:
    def __init__(self, hold_from: int | None = None) -> None:
        self.hold_from = hold_from
        self.release = threading.Event()
        self.held = threading.Event()  # set once a grading waits for `release`
        self.calls: Counter[int] = Counter()
        self.lock = threading.Lock()

    def score(self, item: dict) -> float:
        with self.lock:
            self.calls[item["id"]] += 1
            count = self.calls[item["id"]]
        return {"always0": 0.0, "always1": 1.0}.get(item["kind"], float(count % 2))


def make_app(script: Script) -> FastAPI:
    app = FastAPI()

    @app.post("/grade")
    async def grade(request: Request) -> dict:
        body = await request.json()
        item = body["item"]
        if script.hold_from is not None and item["id"] >= script.hold_from:
            script.held.set()
            await asyncio.to_thread(script.release.wait, 60)
        return {"score": script.score(item)}

    return app


@contextmanager
def scripted_grader(hold_from: int | None = None) -> Iterator[tuple[str, Script]]:
    script = Script(hold_from)
    try:
        with serve_app(make_app(script)) as port:
            yield f"http://127.0.0.1:{port}/grade", script
    finally:
        script.release.set()


def scripted_rows(kinds: list[str]) -> list[dict]:
    search = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                               "parameters": {"type": "object",
                                                              "properties": {"query": {"type": "string"}}}}}
    return [{"messages": [{"role": "user", "content": f"Question {i}: what was revenue in {2000 + i}?"}],
             "tools": [search], "id": i, "kind": kind} for i, kind in enumerate(kinds)]
