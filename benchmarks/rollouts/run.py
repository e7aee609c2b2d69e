"""Rollout engine throughput: 32 rollouts with 4 tool calls each against a tool server that
answers after 200 ms, on the tiny model.

  (a) the engine: every rollout at once, generation batched, tool calls overlapping;
  (b) the same rollouts one after another (the engine with one rollout at a time);
  (c) the bound: the time (a) itself spent inside the model (its generation batches, measured in
      the same run) + one rollout's chain of tool latencies (calls x latency). Rollouts that follow
      the same script move in lockstep, so no schedule beats generating while nobody waits plus
      waiting while nobody generates by much; (a) / (c) is the engine's overhead over that.
      (Before the engine's speed-ups the bound was a separate run's generation time against an instant tool
      server: other batch shapes, and it came out larger than (a) itself.)
Target: (a) at least 5x faster than (b), and within 1.3x of (c).

The tiny model's real forward passes cost what they cost; its logits are then overridden so
each rollout follows a script of 4 tool calls and an answer (a random model calls no tools).

    .venv/bin/python -m benchmarks.rollouts.run [--rollouts 32] [--calls 4] [--latency 0.2]

Prints a table and writes benchmarks/results/rollouts.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.rl.tool_server import tool_server
from workers.models.loading import load_model
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
from workers.engine.toolcalls import ToolSchema
from workers.engine.tools_client import ToolClient

RESULTS = Path(__file__).resolve().parents[1] / "results" / "rollouts.json"
TOOLS = [ToolSchema("search", "Search", {"type": "object", "properties": {"query": {"type": "string"}}}),
         ToolSchema("cat", "Read", {"type": "object", "properties": {"path": {"type": "string"}}})]


class ScriptedTinyModel(torch.nn.Module):
    """Runs the real tiny model, then forces the next token of the rollout's scripted turn."""

    def __init__(self, model: Any, tokenizer: Any, turns: list[str]) -> None:
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.targets = [tokenizer.encode(t + "<|im_end|>", add_special_tokens=False) for t in turns]

    def _target(self, row: list[int]) -> tuple[list[int], int]:
        starts = [i for i in range(len(row) - len(self.header) + 1) if row[i:i + len(self.header)] == self.header]
        return self.targets[min(len(starts) - 1, len(self.targets) - 1)], len(row) - starts[-1] - len(self.header)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **_):  # noqa: ANN001, ANN201
        from transformers.cache_utils import DynamicLayer

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True, logits_to_keep=1)
        # One more cache layer holds the token ids, so every row's context survives the engine's
        # cache handling (rows leaving and joining, caches kept across turns) and can be read back.
        layers = out.cache.layers
        if len(layers) == self.model.config.num_hidden_layers:
            layers.append(DynamicLayer())
        as_keys = input_ids.float()[:, None, :, None]
        ids, _ = layers[-1].update(as_keys, as_keys)
        logits = torch.full_like(out.logits[:, -1:, :], -1e4)
        for row, (row_ids, mask) in enumerate(zip(ids[:, 0, :, 0], attention_mask)):
            target, done = self._target(row_ids[mask.bool()].long().tolist())
            logits[row, 0, target[done] if done < len(target) else self.tokenizer.eos_token_id] = 1e4
        return SimpleNamespace(logits=logits, cache=out.cache)


def script(calls: int) -> list[str]:
    turns = []
    for i in range(calls):
        name, args = ("search", {"query": f"revenue {2020 + i}"}) if i % 2 == 0 else ("cat", {"path": f"acme/{2020 + i}"})
        turns.append(f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>")
    return turns + ["The revenue was 412.5 million."]


async def run_engine(model: Any, tokenizer: Any, url: str, specs: list[RolloutSpec]) -> tuple[float, RolloutEngine, list]:
    endpoints = [{"name": t.name, "server_url": url} for t in TOOLS]
    async with ToolClient(endpoints, allowlist=["127.0.0.1"]) as client:
        engine = RolloutEngine(model, tokenizer, ChatFormatter(tokenizer), client,
                               EngineConfig(max_episode_steps=10, temperature=1.0))
        started = time.perf_counter()
        records = await engine.run(specs)
        return time.perf_counter() - started, engine, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.2)
    args = parser.parse_args()

    loaded = load_model("tiny-smollm2")
    model = ScriptedTinyModel(loaded.model, loaded.tokenizer, script(args.calls))
    specs = [RolloutSpec(i, [{"role": "user", "content": f"What was ACME's revenue? ({i})"}], TOOLS, {"i": i}, seed=i)
             for i in range(args.rollouts)]
    with tool_server(latency_s=args.latency) as (url, recorder):
        engine_s, engine, records = asyncio.run(run_engine(model, loaded.tokenizer, url, specs))
        sequential_s = sum(asyncio.run(run_engine(model, loaded.tokenizer, url, [spec]))[0] for spec in specs)
    assert all(len(r.tool_calls) == args.calls and r.finish_reason == "answered" for r in records), "script not followed"
    lower_bound_s = engine.generation_s + args.calls * args.latency
    rows = {
        "rollouts": args.rollouts, "tool_calls_per_rollout": args.calls, "tool_latency_s": args.latency,
        "tool_calls_served": len(recorder.calls),
        "a_engine_s": round(engine_s, 3), "b_sequential_s": round(sequential_s, 3),
        "c_bound_s": round(lower_bound_s, 3), "engine_time_in_model_s": round(engine.generation_s, 3),
        "prefills": len(engine.prefill_rows), "largest_batch": engine.largest_batch,
        "speedup_a_vs_b": round(sequential_s / engine_s, 2), "a_over_c": round(engine_s / lower_bound_s, 3),
    }
    rows["targets_met"] = rows["speedup_a_vs_b"] >= 5 and rows["a_over_c"] <= 1.3
    print(f"{'measure':44} value")
    for key, value in rows.items():
        print(f"{key:44} {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
