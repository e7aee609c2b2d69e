"""The financial-reports endpoint grader: the right number, found with few tool calls and tokens.

    python -m examples.financial_reports.grader_server --tool-server http://127.0.0.1:8001 --port 8002

`POST /grade` with `{"sample", "item", "trace_id"}` answers `{"score", "details"}`:

    correct    = 1 if the first number of sample.output_text that is not a bare year matches item.answer (with item.scale),
                 within 1 % (the numeric_match grader's parsing: "$1,234.5", "(12)", "7%", "1.2 million")
    calls      = how many tool calls the tool server logged for this trace_id (GET /traces/{trace_id})
    tokens     = sample.usage.completion_tokens + sample.usage.tool_output_tokens (what the rollout wrote and read)
    efficiency = max(floor, 1 - call_penalty * max(0, calls - free_calls) - token_penalty * tokens / 1000)
    score      = correct * efficiency

The defaults (free_calls 2, call_penalty 0.05, token_penalty 0, floor 0.5) make two calls (search,
cat) free; the demo charges every call after the first and every token (--free-calls 1
--call-penalty 0.1 --token-penalty 0.25 --floor 0.2). So a wrong answer scores 0 however it was
found, and a right one scores between the floor and 1: within a group of rollouts of the same
question, the ones that browsed less score higher. Without a tool server URL the calls are not
charged.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Header, HTTPException
from pydantic import BaseModel, Field

from agent_rft.graders.core import GraderError
from agent_rft.graders.implementations.numeric_match import (
    amounts_match,
    pick_amount,
    reference_amount,
)


class GradeSample(BaseModel):
    output_text: str = ""
    output_json: Any = None
    output_tools: list[Any] = Field(default_factory=list)
    choices: list[Any] = Field(default_factory=list)
    trajectory: list[Any] = Field(default_factory=list)
    usage: dict[str, Any] = Field(default_factory=dict)


class GradeRequest(BaseModel):
    sample: GradeSample
    item: dict[str, Any]
    trace_id: str = ""


def is_correct(output_text: str, answer: str, scale: str, rel_tol: float = 0.01) -> bool:
    reference = reference_amount(str(answer), scale)
    given = pick_amount(output_text, "first", ignore_years=True)
    return given is not None and amounts_match(given, reference, rel_tol, 1e-9)


@dataclass(frozen=True)
class Charges:
    """What finding the answer costs: see the module's docstring."""

    free_calls: int = 2
    call_penalty: float = 0.05
    token_penalty: float = 0.0  # per 1,000 tokens written and read
    floor: float = 0.5

    def flags(self) -> list[str]:
        """These charges as the command line's flags (main)."""
        return ["--free-calls", str(self.free_calls), "--call-penalty", str(self.call_penalty),
                "--token-penalty", str(self.token_penalty), "--floor", str(self.floor)]

    def efficiency(self, calls: int, tokens: int = 0) -> float:
        cost = self.call_penalty * max(0, calls - self.free_calls) + self.token_penalty * tokens / 1000
        return max(self.floor, 1.0 - cost)


def rollout_tokens(usage: dict[str, Any]) -> int:
    return int(usage.get("completion_tokens") or 0) + int(usage.get("tool_output_tokens") or 0)


def create_grader_app(tool_server_url: str | None, *, token: str | None = None,
                      tool_server_token: str | None = None, charges: Charges = Charges(), rel_tol: float = 0.01,
                      timeout_s: float = 10.0) -> FastAPI:
    """`tool_server_url` is the tool server's base URL (its `/traces/{id}` is read); None: the calls
    are not charged (the tokens still are). With `token`, requests need `Authorization: Bearer <token>`;
    `tool_server_token` is sent to the tool server."""
    app = FastAPI(title="financial-reports grader")
    base = tool_server_url.rstrip("/").removesuffix("/tools") if tool_server_url else None
    headers = {"Authorization": f"Bearer {tool_server_token}"} if tool_server_token else {}

    async def tool_calls(trace_id: str) -> int | None:
        if base is None:
            return None
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            try:
                response = await client.get(f"{base}/traces/{trace_id}", headers=headers)
            except httpx.HTTPError as exc:
                # 5xx: the service retries, then excludes the rollout rather than mis-scoring it.
                raise HTTPException(503, f"tool server unreachable: {type(exc).__name__}") from None
        if response.status_code == 404:
            return 0  # the tool server saw no call of this rollout
        if response.status_code != 200:
            raise HTTPException(502, f"tool server answered HTTP {response.status_code} for the trace")
        return int(response.json()["count"])

    @app.post("/grade")
    async def grade(request: GradeRequest, authorization: str = Header("")) -> dict[str, Any]:
        if token is not None and authorization != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong bearer token")
        if "answer" not in request.item:
            raise HTTPException(400, "item has no 'answer'")
        try:
            correct = is_correct(request.sample.output_text, request.item["answer"],
                                 str(request.item.get("scale") or ""), rel_tol)
        except GraderError as exc:
            raise HTTPException(400, f"unreadable reference answer: {exc}") from None
        calls = await tool_calls(request.trace_id) if request.trace_id else None
        tokens = rollout_tokens(request.sample.usage)
        factor = charges.efficiency(calls or 0, tokens)
        score = float(correct) * factor
        return {"score": score,
                "details": {"correct": correct, "tool_calls": calls, "tokens": tokens, "efficiency": factor}}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Grade financial-reports answers (numeric match x efficiency).")
    parser.add_argument("--tool-server", default=None, help="tool server base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--token", default=os.environ.get("FIN_GRADER_TOKEN"))
    parser.add_argument("--tool-server-token", default=os.environ.get("FIN_TOOLS_TOKEN"))
    defaults = Charges()
    parser.add_argument("--free-calls", type=int, default=defaults.free_calls, help="tool calls not charged")
    parser.add_argument("--call-penalty", type=float, default=defaults.call_penalty, help="per call after the free ones")
    parser.add_argument("--token-penalty", type=float, default=defaults.token_penalty,
                        help="per 1,000 tokens the rollout wrote (completion) and read (tool output)")
    parser.add_argument("--floor", type=float, default=defaults.floor, help="the least a right answer scores")
    args = parser.parse_args(argv)
    charges = Charges(args.free_calls, args.call_penalty, args.token_penalty, args.floor)
    app = create_grader_app(args.tool_server, token=args.token, tool_server_token=args.tool_server_token,
                            charges=charges)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
