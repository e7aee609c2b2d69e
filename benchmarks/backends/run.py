"""Rollout backends side by side: the in-process engine against vLLM, in one run.

  rollouts  64 rollouts (16 questions x 4) of SmolLM2-135M-Instruct calling a `search` tool whose
            server answers after 200 ms (up to 2 calls, 64 tokens a turn, temperature 0.7): wall
            seconds, rollouts/s and sampled tokens/s; the sampled tokens' log-prob mismatch against
            the trainer's forward pass (how closely the backend samples the trainer's policy).
  demo      `--steps` training steps of the demo's own configuration (benchmarks/demo_learning:
            LoRA, the financial-reports tool server, the demo's grader): step and sampling seconds,
            train.logprob_mismatch, and for vLLM the seconds to swap in each new adapter.

The two sides alternate, `--repeats` times each; the table gives medians. vLLM is the server at
`--vllm-url` (it must serve SmolLM2-135M-Instruct under that name, with --logprobs-mode
processed_logprobs and --enable-lora: docs/vllm.md), or one started here from the environment
scripts/test.sh installs. Nothing here is CPU-specific: on a CUDA machine it compares vLLM's GPU
build with the engine on CUDA (`--device cuda`).

    .venv/bin/python -m benchmarks.backends.run [--parts rollouts,demo] [--repeats 3] [--steps 2]
                                                [--vllm-url http://127.0.0.1:8000] [--device cpu]

Prints a table and writes benchmarks/results/backends.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "backends.json"
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ('You have a tool named search. Example:\nUser: What was Foo Corp revenue in 2021?\n'
          'Assistant: <tool_call>{"name": "search", "arguments": {"query": "Foo Corp revenue 2021"}}</tool_call>')
COMPANIES = ["ACME", "Globex", "Initech", "Umbrella", "Hooli", "Stark", "Wayne", "Wonka"]


def questions() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"What was {company}'s revenue in {year}?"}]
            for company in COMPANIES for year in (2022, 2023)]


def make_sampler(backend: str, config: Any, vllm_url: str, prefix: str) -> Any:
    """The vLLM sampler, or None: the engine's own in-process sampler."""
    from workers.engine.vllm_sampler import VLLMSampler

    return VLLMSampler([vllm_url], model=MODEL, config=config, adapter_prefix=prefix) if backend == "vllm" else None


# --- 64 rollouts with 200 ms tools -------------------------------------------------------------


def measure_rollouts(backend: str, loaded: Any, tool_url: str, vllm_url: str) -> dict[str, Any]:
    from workers.engine.generation import sequence_logprobs
    from workers.engine.prompting import ChatFormatter
    from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
    from workers.engine.toolcalls import ToolSchema
    from workers.engine.tools_client import ToolClient

    search = ToolSchema("search", "Search the reports", {"type": "object", "properties": {"query": {"type": "string"}},
                                                         "required": ["query"]})
    config = EngineConfig(max_tokens_per_turn=64, max_tokens_per_rollout=128, max_episode_steps=2, temperature=0.7)
    formatter = ChatFormatter(loaded.tokenizer)
    specs = [RolloutSpec(i, messages, [search], {}, seed=i * 4 + k) for i, messages in enumerate(questions())
             for k in range(4)]

    async def go() -> tuple[list[Any], float]:
        async with ToolClient([{"name": "search", "server_url": tool_url}], allowlist=["127.0.0.1"]) as client:
            sampler = make_sampler(backend, config, vllm_url, "bench")
            engine = RolloutEngine(loaded.model, loaded.tokenizer, formatter, client, config, sampler=sampler)
            started = time.perf_counter()
            records = await engine.run(specs)
            return records, time.perf_counter() - started

    records, seconds = asyncio.run(go())
    sampled = sum(r.completion_tokens for r in records)
    gaps = []
    for record in records[:16]:  # the mismatch on a quarter of them: a forward pass each
        recomputed = sequence_logprobs(loaded.model, record.token_ids, temperature=0.7)
        gaps += [abs(recomputed[i] - lp) for i, (m, lp) in enumerate(zip(record.loss_mask, record.logprobs)) if m]
    return {"seconds": seconds, "rollouts_per_s": len(records) / seconds, "sampled_tokens_per_s": sampled / seconds,
            "sampled_tokens": sampled, "tool_calls_per_rollout": sum(len(r.tool_calls) for r in records) / len(records),
            "logprob_mismatch": statistics.mean(gaps) if gaps else None}


# --- the demo's training steps ----------------------------------------------------------------------


def measure_demo(backend: str, loaded_dtype: str, steps: int, vllm_url: str, device: str) -> dict[str, Any]:
    from agent_rft.graders.core import GraderContext
    from benchmarks.demo_learning import run as demo
    from workers.models.loading import load_model
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.trainer import Trainer

    settings = demo.demo_settings()
    settings["training"]["steps"] = steps
    with tempfile.TemporaryDirectory(prefix="backends-") as tmp, ExitStack() as stack:
        corpus, train_rows, held_out = demo.build_task(settings, Path(tmp) / "data")
        port = demo.serve_tools(stack, corpus, Path(tmp) / "index")
        loaded = load_model(settings["model"], dtype=loaded_dtype, device=device)

        async def go() -> tuple[list[dict[str, Any]], Any]:
            async with ToolClient(demo.tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
                config = demo.training_config(settings, len(train_rows), seed=0)
                config = replace(config, eval_interval=10_000 * config.n_epochs)
                sampler = make_sampler(backend, config.engine, vllm_url, f"demo-{time.time_ns()}")
                hooks = demo.QuietHooks(steps)
                trainer = Trainer(loaded=loaded, config=config, train_rows=train_rows, valid_rows=held_out[:1],
                                  grader=demo.grader(settings), grader_ctx=GraderContext(), tool_client=client,
                                  job_tools=demo.tool_endpoints(port), work_dir=Path(tmp) / "run", hooks=hooks,
                                  sampler=sampler)
                await trainer.run()
                return hooks.metrics, sampler

        metrics, sampler = asyncio.run(go())
    timing = [m["timing"]["step"] for m in metrics]
    mismatch = [m["train"]["logprob_mismatch"] for m in metrics if m["train"].get("logprob_mismatch") is not None]
    return {"step_s": statistics.median(t["full_iteration"] for t in timing),
            "sampling_s": statistics.median(t["sampling"] for t in timing),
            "logprob_mismatch": statistics.median(mismatch) if mismatch else None,
            "adapter_swap_s": statistics.median(sampler.publish_s) if sampler and sampler.publish_s else None}


# --- the run -------------------------------------------------------------------------------------


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = runs[0].keys()
    return {k: (statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs) else None) for k in keys}


def table(title: str, results: dict[str, dict[str, Any]]) -> str:
    keys = list(results["engine"])
    lines = [title, "| measure | engine | vLLM | vLLM / engine |", "|---|---|---|---|"]
    for key in keys:
        a, b = results["engine"][key], results["vllm"][key]
        ratio = f"{b / a:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "–"
        fmt = lambda v: "–" if v is None else f"{v:.4g}"  # noqa: E731
        lines.append(f"| {key} | {fmt(a)} | {fmt(b)} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="rollouts,demo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vllm-url", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    out: dict[str, Any] = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {platform.processor()}",
                           "device": args.device, "repeats": args.repeats, "command": " ".join(["run.py", *(argv or [])])}
    with ExitStack() as stack:
        url = args.vllm_url or stack.enter_context(started_vllm())
        if "rollouts" in parts:
            from tests.rl.tool_server import tool_server
            from workers.models.loading import load_model

            loaded = load_model(MODEL, dtype=args.dtype, device=args.device)
            tool_url, _ = stack.enter_context(tool_server(latency_s=0.2))
            runs: dict[str, list[dict[str, Any]]] = {"engine": [], "vllm": []}
            for _ in range(args.repeats):
                for backend in ("engine", "vllm"):
                    runs[backend].append(measure_rollouts(backend, loaded, tool_url, url))
            out["rollouts"] = {backend: medians(r) for backend, r in runs.items()}
            print(table("64 rollouts, 200 ms tools (medians)", out["rollouts"]))
        if "demo" in parts:
            runs = {"engine": [], "vllm": []}
            for _ in range(args.repeats):
                for backend in ("engine", "vllm"):
                    runs[backend].append(measure_demo(backend, args.dtype, args.steps, url, args.device))
            out["demo"] = {backend: medians(r) for backend, r in runs.items()}
            print(table(f"the demo's training step ({args.steps} steps a run, medians)", out["demo"]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


@contextmanager
def started_vllm() -> Iterator[str]:
    """A vLLM server from the environment scripts/test.sh installs (the tests' own launcher)."""
    from tests.conftest import vllm_process

    with vllm_process(Path(tempfile.mkdtemp(prefix="backends-vllm-")) / "vllm.log") as (url, _):
        yield url


if __name__ == "__main__":
    main()
