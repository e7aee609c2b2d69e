"""Demo training steps, the engine before its speed-ups against this checkout's, in one run (the
speed-ups' first target).

The baseline is the commit before the first engine change (BASELINE_REV), checked out in a
temporary git worktree. Each measurement is a subprocess that imports everything (workers, app,
examples) from one tree and runs `--steps` training steps of the demo's own configuration
(benchmarks/demo_learning: SmolLM2-135M, bf16 where native, 4 prompts x 4 rollouts, LoRA, the
financial-reports tool server on 127.0.0.1, the demo's grader), same seeds in both trees. Old and
new alternate, `--repeats` times each; the table gives medians.

Per run: median step time and its parts, the tokens of the step's rollouts, those the update
trains on (groups with a reward spread) and the update's seconds per 1,000 of them (the two sides
sample different rollouts; this compares the update on equal terms), prefill tokens (the new engine counts what it fed; what the old engine feeds for the
same rollouts is every turn's whole context, counted from the rollouts' token arrays), sampled-token log-prob mismatch, peak RSS of the process, and a hash of
the first step's sampled tokens (same seeds: the same hash means the sampler's output is unchanged).

    .venv/bin/python -m benchmarks.engine.demo_step [--steps 3 --repeats 2]

Writes benchmarks/results/engine_demo_step.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "engine_demo_step.json"
BASELINE_REV = "acc9350"  # the last commit before the engine's speed-ups


def child(steps: int) -> dict[str, Any]:
    """One measurement in this process, with whatever tree is first on sys.path."""
    import torch

    from benchmarks.demo_learning import run as demo
    from workers.engine import rollout as rollout_module
    from workers.methods.reinforcement import trainer as trainer_module

    torch.set_num_threads(2)
    captured: list[dict[str, Any]] = []
    original_run = rollout_module.RolloutEngine.run

    async def recording_run(self, specs):  # noqa: ANN001, ANN202
        records = await original_run(self, specs)
        fed = getattr(self, "prefill_tokens", None)
        whole = sum(start for r in records for start, _ in _spans(r))
        sampled = [t for r in records for t, m in zip(r.token_ids, r.loss_mask) if m]
        captured.append({"prefill_tokens": fed if fed is not None else whole, "whole_context_tokens": whole,
                         "sequence_tokens": sum(len(r.token_ids) for r in records), "update_tokens": 0,
                         "sampled_hash": hashlib.sha256(json.dumps(sampled).encode()).hexdigest()[:16]})
        return records

    def _spans(record):  # noqa: ANN001, ANN202 - the baseline's RolloutRecord has no sampled_spans
        mask, spans, start = [*record.loss_mask, 0], [], None
        for i, flag in enumerate(mask):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                spans.append((start, i))
                start = None
        return spans

    rollout_module.RolloutEngine.run = recording_run
    original_update = trainer_module.Trainer._update

    def recording_update(self, sequences):  # noqa: ANN001, ANN202 - the tokens the update trains on
        captured[-1]["update_tokens"] = sum(len(s.token_ids) for s in sequences)
        return original_update(self, sequences)

    trainer_module.Trainer._update = recording_update
    settings = demo.demo_settings()
    settings["training"]["steps"] = steps
    with tempfile.TemporaryDirectory(prefix="engine-step-") as tmp, ExitStack() as stack:
        corpus, train_rows, held_out = demo.build_task(settings, Path(tmp) / "data")
        port = demo.serve_tools(stack, corpus, Path(tmp) / "index")
        metrics = asyncio.run(_train(demo, settings, port, train_rows, held_out, Path(tmp) / "run"))
    steps_out = []
    for m, sample in zip(metrics, captured):
        timing = m["timing"]
        steps_out.append({"step_s": timing["step"]["full_iteration"], "sampling_s": timing["step"]["sampling"],
                          "training_s": timing["step"]["training"], "breakdown": timing.get("breakdown"),
                          "logprob_mismatch": m["train"].get("logprob_mismatch"), **sample})
    return {"steps": steps_out, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


async def _train(demo: Any, settings: dict[str, Any], port: int, train_rows: list[dict], held_out: list[dict],
                 work_dir: Path) -> list[dict[str, Any]]:
    from dataclasses import replace

    from agent_rft.graders.core import GraderContext
    from workers.models.loading import load_model
    from workers.engine.tools_client import ToolClient
    from workers.methods.reinforcement.trainer import Trainer

    loaded = load_model(settings["model"], dtype=settings["dtype"])
    async with ToolClient(demo.tool_endpoints(port), allowlist=["127.0.0.1"]) as client:
        config = demo.training_config(settings, len(train_rows), seed=0)
        config = replace(config, eval_interval=10_000 * config.n_epochs)
        hooks = demo.QuietHooks(settings["training"]["steps"])
        trainer = Trainer(loaded=loaded, config=config, train_rows=train_rows, valid_rows=held_out[:1],
                          grader=demo.grader(settings), grader_ctx=GraderContext(), tool_client=client,
                          job_tools=demo.tool_endpoints(port), work_dir=work_dir, hooks=hooks)
        await trainer.run()
    return hooks.metrics


def measure(tree: Path, steps: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    # Run as a script (the baseline tree has no benchmarks/engine): this file from REPO, the rest from `tree`.
    done = subprocess.run([sys.executable, __file__, "--child", str(tree), "--steps", str(steps)], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"measurement in {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [s for run in runs for s in run["steps"]]
    median = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    parts: dict[str, float] = {}
    if all(s["breakdown"] for s in steps):
        for key in steps[0]["breakdown"]:
            parts[key] = statistics.median(s["breakdown"][key] for s in steps)
    mismatch = [s["logprob_mismatch"] for s in steps if s["logprob_mismatch"] is not None]
    per_1000 = [1000 * s["training_s"] / s["update_tokens"] for s in steps if s.get("update_tokens")]
    return {"step_s": median("step_s"), "sampling_s": median("sampling_s"), "training_s": median("training_s"),
            "sequence_tokens": median("sequence_tokens"), "update_tokens": median("update_tokens"),
            "update_s_per_1000_tokens": statistics.median(per_1000) if per_1000 else None,
            "prefill_tokens": median("prefill_tokens"), "whole_context_tokens": median("whole_context_tokens"),
            "logprob_mismatch": statistics.median(mismatch) if mismatch else None,
            "peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in runs), "breakdown": parts,
            "first_step_hashes": sorted({r["steps"][0]["sampled_hash"] for r in runs}), "step_times": [s["step_s"] for s in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a measurement, in that tree
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(args.child))
        print("RESULT " + json.dumps(child(args.steps)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="engine-baseline-") as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), BASELINE_REV],
                       check=True, capture_output=True)
        try:
            runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            for repeat in range(args.repeats):
                for path, tree in (("old", baseline), ("new", REPO)):
                    runs[path].append(measure(tree, args.steps))
                    print(f"repeat {repeat + 1} {path}: steps {[round(s['step_s'], 1) for s in runs[path][-1]['steps']]}",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    old, new = summarize(runs["old"]), summarize(runs["new"])
    rows = [("demo step (median)", "step_s", "s"), ("  sampling", "sampling_s", "s"), ("  update", "training_s", "s"),
            ("tokens of the step's rollouts", "sequence_tokens", ""),
            ("  of them trained on (groups with a reward spread)", "update_tokens", ""),
            ("  update per 1,000 trained tokens", "update_s_per_1000_tokens", "s"),
            ("prefill tokens per step", "prefill_tokens", ""), ("peak RSS", "peak_rss_gb", "GB")]
    print(f"\n| measure | old ({BASELINE_REV}) | new | new / old |\n|---|---|---|---|")
    for label, key, unit in rows:
        print(f"| {label} | {old[key]:.2f} {unit} | {new[key]:.2f} {unit} | {new[key] / old[key]:.2f} |")
    print(f"| prefill tokens of the new side's rollouts, fed as the old engine feeds them (every turn's whole "
          f"context) and as the new one does | {new['whole_context_tokens']:.0f} | {new['prefill_tokens']:.0f} | "
          f"{new['prefill_tokens'] / new['whole_context_tokens']:.2f} |")
    print(f"| sampled-token log-prob mismatch | {old['logprob_mismatch']:.4f} | {new['logprob_mismatch']:.4f} | |")
    print(f"| first step's sampled tokens (hash) | {old['first_step_hashes']} | {new['first_step_hashes']} | "
          f"{'same' if old['first_step_hashes'] == new['first_step_hashes'] else 'different'} |")
    if new["breakdown"]:
        print("\nnew path, median seconds per part of a step: "
              + ", ".join(f"{k} {v:.1f}" for k, v in new["breakdown"].items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"baseline_rev": BASELINE_REV, "steps": args.steps, "repeats": args.repeats,
                                   "old": old, "new": new}, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
