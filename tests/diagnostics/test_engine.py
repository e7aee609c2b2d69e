"""workers/methods/reinforcement/diagnostic.py with the real rollout engine, a real tool server and a real endpoint
grader; the policy is scripted (tests/rl/policies.py), so every tool call is known."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import TypeAdapter

from app.diagnostics.summary import build_result
from agent_rft.graders.core import GraderContext
from agent_rft.graders.schemas import Grader
from app.jobs.schemas import TrainingOptions
from tests.diagnostics.scripted_grader import scripted_grader
from tests.rl.policies import ScriptedPolicy
from tests.rl.tool_server import tool_server
from workers.training.data import job_tool_schemas, prompts_from_rows, rollout_seed
from workers.methods.reinforcement.diagnostic import load_basis, run_diagnostic, select_samples
from workers.models.loading import load_model
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine
from workers.engine.toolcalls import HermesParser
from workers.engine.tools_client import ToolClient

TOOLS = [{"name": name, "description": name, "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
         for name in ("search", "cat")]


def call(name: str, q: str) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": {"q": q}})}</tool_call>'


# Two searches at once in the first turn, one cat in the second, then the answer.
SCRIPT = [call("search", "a") + call("search", "b"), call("cat", "c"), "The answer is 42."]


class Hooks:
    def __init__(self, cancel_after_chunks: int | None = None) -> None:
        self.chunks: list[list[dict]] = []
        self.cancel_after = cancel_after_chunks

    async def on_rollouts(self, records: list[dict]) -> None:
        self.chunks.append(records)

    async def control(self) -> str:
        return "cancel" if self.cancel_after is not None and len(self.chunks) >= self.cancel_after else "continue"


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return load_model("tiny-smollm2").tokenizer


def diagnose(tokenizer, kinds: list[str], hooks: Hooks, *, runs: int = 2, done=frozenset(), chunk=4):  # noqa: ANN001, ANN201
    rows = [{"messages": [{"role": "user", "content": f"Question {i}. SCRIPT=s"}], "id": i, "kind": kind}
            for i, kind in enumerate(kinds)]
    with tool_server() as (tool_url, recorder), scripted_grader() as (grader_url, script):
        async def go():  # noqa: ANN202
            async with ToolClient([{**t, "server_url": tool_url} for t in TOOLS], allowlist=["127.0.0.1"]) as tools:
                # A parser that lets one turn make several calls (the default stops at the first).
                formatter = ChatFormatter(tokenizer, HermesParser(stop_at_first_call=False))
                engine = RolloutEngine(ScriptedPolicy(tokenizer, {"s": SCRIPT}), tokenizer, formatter, tools,
                                       EngineConfig(max_tokens_per_turn=128))
                grader = TypeAdapter(Grader).validate_python({"type": "endpoint", "name": "g", "url": grader_url})
                return await run_diagnostic(
                    engine=engine, grader=grader, grader_ctx=GraderContext(outbound_allowlist=["127.0.0.1"]),
                    prompts=prompts_from_rows(rows, job_tool_schemas(TOOLS), source="training"),
                    sample_indexes=select_samples(len(rows), None, 0), runs_per_sample=runs, seed=9, hooks=hooks,
                    done=done, chunk_rollouts=chunk)

        return asyncio.run(go()), recorder, script


def test_every_sample_runs_k_times_in_chunks_and_is_graded(tokenizer):
    hooks = Hooks()
    outcome, recorder, script = diagnose(tokenizer, ["always0", "always1", "mixed"], hooks)
    assert outcome.status == "succeeded" and outcome.samples_run == 3
    assert [len(c) for c in hooks.chunks] == [4, 2]  # 4 rollouts a chunk: two samples, then one
    records = [r for chunk in hooks.chunks for r in chunk]
    assert [(r["sample_index"], r["run_index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r["reward"] for r in records[:4]] == [0.0, 0.0, 1.0, 1.0] and sorted(r["reward"] for r in records[4:]) == [0, 1]
    assert all(r["finish_reason"] == "answered" and r["excluded"] is None for r in records)
    assert len(recorder.calls) == 6 * 3 and sum(script.calls.values()) == 6
    # The two searches of the first turn share a turn: what the load projection's concurrency uses.
    assert [(c["name"], c["turn"]) for c in records[0]["tool_calls"]] == [("search", 1), ("search", 1), ("cat", 2)]

    stored = [{**r, "data": r} for r in records]
    basis = {"tool_max_concurrency": 16, "settings": [
        {"compute_multiplier": 1.0, "batch_size": 3, "group_size": 4, "configured": True}]}
    result = build_result(stored, runs_per_sample=2, load_basis=basis)
    assert [s["signal"] for s in result["samples"]] == ["always_0", "always_1", "mixed"]
    assert result["samples"][0]["tool_calls"] == [{"cat": 1, "search": 2}] * 2
    tools = result["summary"]["load_projection"][0]["tools"]
    formula = ("calls_per_rollout", "calls_per_step", "max_simultaneous_per_rollout", "peak_concurrency",
               "peak_concurrency_uncapped")
    assert {k: tools["search"][k] for k in formula} == {
        "calls_per_rollout": 2.0, "calls_per_step": 24.0, "max_simultaneous_per_rollout": 2, "peak_concurrency": 16,
        "peak_concurrency_uncapped": 24}
    wall = sum(r["wall_time_s"] for r in records) / len(records)  # measured: requests/s follow the real rollouts
    assert tools["search"]["requests_per_s"] == pytest.approx(24.0 / wall)
    assert tools["search"]["rate_limit"] is None and tools["search"]["throttled"] is False
    assert tools["cat"]["calls_per_step"] == 12 and tools["cat"]["peak_concurrency"] == 12


def test_cancel_stops_at_a_chunk_boundary_and_done_samples_are_skipped(tokenizer):
    hooks = Hooks(cancel_after_chunks=1)
    outcome, _, _ = diagnose(tokenizer, ["mixed"] * 4, hooks, runs=2, chunk=4)
    assert outcome.status == "cancelled" and outcome.samples_run == 2 and len(hooks.chunks) == 1
    resumed = Hooks()
    outcome, _, _ = diagnose(tokenizer, ["mixed"] * 4, resumed, runs=2, chunk=4, done=frozenset({0, 1}))
    assert outcome.status == "succeeded" and {r["sample_index"] for c in resumed.chunks for r in c} == {2, 3}


def test_sample_choice_seeds_and_load_basis():
    assert select_samples(5, None, 1) == [0, 1, 2, 3, 4] and select_samples(5, 9, 1) == list(range(5))
    picked = select_samples(100, 10, 7)
    assert len(picked) == 10 and picked == sorted(picked) and picked == select_samples(100, 10, 7)
    assert picked != select_samples(100, 10, 8)
    assert rollout_seed(9, "diagnostic", 2, 0) != rollout_seed(9, "diagnostic", 2, 1)
    basis = load_basis(TrainingOptions.model_validate({"hyperparameters": {"compute_multiplier": 3, "batch_size": "auto"}}),
                       n_train=5, seed=0,
                       tool_max_concurrency=16)
    assert [(s["compute_multiplier"], s["batch_size"], s["group_size"], s["configured"]) for s in basis["settings"]] == [
        (0.5, 5, 2, False), (1.0, 5, 4, False), (2.0, 5, 8, False), (3.0, 5, 12, True), (4.0, 5, 16, False),
        (10.0, 5, 40, False)]
    assert basis["n_train"] == 5 and basis["tool_max_concurrency"] == 16
    assert (basis["max_staleness"], basis["prompts_per_step_factor"]) == (0, 1)
    assert {s["eval_samples"] for s in basis["settings"]} == {5}  # auto: every training row, as the trainer resolves
    ahead = load_basis(TrainingOptions.model_validate({"x_open_model": {"max_staleness": 1, "refill_zero_spread": True}}),
                       n_train=5, seed=0, tool_max_concurrency=16)
    assert (ahead["max_staleness"], ahead["prompts_per_step_factor"]) == (1, 4)
