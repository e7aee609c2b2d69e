"""float32 against bfloat16 (`x_open_model.dtype`) for SmolLM2-135M-Instruct on the CPU: the
demo's step, sampling and update timed side by side in one run, with float32 as the baseline.

The work is the demo's (examples/financial_reports/demo_config.py, through
benchmarks/demo_learning's helpers): `--prompts` training questions × `--group` rollouts with the
demo's engine settings against the real example tool server, and one GRPO update (LoRA r16,
the demo's learning rate) over those rollouts.

- sampling: each dtype runs the same rollout specs (same seeds) through the rollout engine; the
  texts differ a little between dtypes, so the time is also given per processed token (prompt,
  tool output and sampled tokens: what the forward passes see);
- update: each dtype updates on the SAME sequences (those float32 sampled, advantages ±1), so the
  update times compare identical work; median of `--repeats`;
- logprob_mismatch: each dtype's update on its OWN samples reports mean |log p(trainer) -
  log p(sampler)| (train.logprob_mismatch of the step metrics): the precision paid.

    .venv/bin/python -m benchmarks.precision.run [--prompts 4] [--group 4] [--repeats 2]

Prints a table and writes benchmarks/results/precision.json. Target: bfloat16 / float32 time
≤ 0.8 for sampling and for the update on a CPU with native bf16 (AVX512-BF16 / AMX); elsewhere
the benchmark says bfloat16 is emulated and the demo stays in float32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.demo_learning import run as demo_learning

RESULTS = demo_learning.REPO / "benchmarks" / "results" / "precision.json"
DTYPES = ("float32", "bfloat16")


async def measure(dtype: str, settings: dict[str, Any], port: int, rows: list[dict], group: int,
                  common: list[Any] | None, repeats: int, work_dir: Path) -> tuple[dict[str, Any], list[Any]]:
    from agent_rft.graders.core import GraderContext
    from workers.models.loading import load_model
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.trainer import Trainer
    from workers.training.sequences import TrainSequence

    loaded = load_model(settings["model"], dtype=dtype)
    async with ToolClient(demo_learning.tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        config = demo_learning.training_config(settings, len(rows), seed=0)
        trainer = Trainer(loaded=loaded, config=config, train_rows=rows, valid_rows=[],
                          grader=demo_learning.grader(settings), grader_ctx=GraderContext(), tool_client=client,
                          job_tools=demo_learning.tool_endpoints(port), work_dir=work_dir,
                          hooks=demo_learning.QuietHooks(1))
        trainer._setup()  # the LoRA model, optimizer and engine, as a job builds them
        specs = [demo_learning_spec(trainer, i, k) for i in range(len(rows)) for k in range(group)]
        started = time.perf_counter()
        records = await trainer.engine.run(specs)
        sampling = time.perf_counter() - started
    own = [TrainSequence.from_record(r, 1.0 if i % 2 else -1.0) for i, r in enumerate(records)]
    mismatch = trainer._update(own)  # before any timed update: the policy that sampled
    sequences = common if common is not None else own
    updates = []
    for _ in range(repeats):
        started = time.perf_counter()
        trainer._update(sequences)
        updates.append(time.perf_counter() - started)
    processed = sum(r.prompt_tokens + r.tool_output_tokens + r.completion_tokens for r in records)
    return {"dtype": dtype, "sampling_s": sampling, "rollouts": len(records),
            "processed_tokens": processed, "sampled_tokens": sum(r.completion_tokens for r in records),
            "sampling_ms_per_processed_token": 1000 * sampling / processed,
            "tool_calls_per_rollout": sum(len(r.tool_calls) for r in records) / len(records),
            "update_s": median(updates), "update_s_all": updates,
            "update_tokens": sum(len(s.token_ids) for s in sequences),
            "logprob_mismatch": mismatch.logprob_mismatch, "clip_fraction": mismatch.clip_fraction}, own


def demo_learning_spec(trainer: Any, row: int, k: int) -> Any:
    from workers.training.data import rollout_seed, spec_for

    return spec_for(trainer.train_prompts[row], rollout_seed(0, "precision", row, k))


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results["float32"]
    lines = ["| | float32 | bfloat16 | bf16 / fp32 |", "|---|---|---|---|"]
    for key, label, fmt in (("sampling_s", "sampling (s)", ".1f"),
                            ("sampling_ms_per_processed_token", "sampling (ms per processed token)", ".2f"),
                            ("update_s", "update on the same sequences (s)", ".1f")):
        a, b = base[key], results["bfloat16"][key]
        lines.append(f"| {label} | {a:{fmt}} | {b:{fmt}} | {b / a:.2f} |")
    for key, label in (("processed_tokens", "processed tokens (sampling)"), ("tool_calls_per_rollout", "tool calls per rollout"),
                       ("logprob_mismatch", "logprob mismatch (own samples)"), ("clip_fraction", "clip fraction")):
        a, b = base[key], results["bfloat16"][key]
        lines.append(f"| {label} | {a:.4g} | {b:.4g} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import torch

    from workers.models.loading import native_bf16_cpu

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the demo's 2 cores)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = demo_learning.demo_settings()
    native = native_bf16_cpu()
    print(f"CPU with native bf16: {native}; torch threads: {torch.get_num_threads()}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp, ExitStack() as stack:
        corpus, train_rows, _ = demo_learning.build_task(settings, Path(tmp) / "data")
        port = demo_learning.serve_tools(stack, corpus, Path(tmp) / "index")
        common = None
        for dtype in DTYPES:
            results[dtype], own = asyncio.run(measure(dtype, settings, port, train_rows[: args.prompts], args.group,
                                                      common, args.repeats, Path(tmp) / dtype))
            common = common or own
            print(f"{dtype}: {json.dumps({k: v for k, v in results[dtype].items() if k != 'update_s_all'})}",
                  flush=True)
    ratios = {key: results["bfloat16"][key] / results["float32"][key]
              for key in ("sampling_s", "sampling_ms_per_processed_token", "update_s")}
    out = {"native_bf16_cpu": native, "threads": args.threads, "prompts": args.prompts, "group": args.group,
           "model": settings["model"], "results": results, "ratios_bf16_over_fp32": ratios,
           "target": "bf16/fp32 <= 0.8 for sampling (per processed token) and the update, where bf16 is native",
           "met": native and ratios["sampling_ms_per_processed_token"] <= 0.8 and ratios["update_s"] <= 0.8}
    print(table(results))
    print(f"target met: {out['met']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
