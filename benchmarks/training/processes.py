"""One policy update on 1 and on N training processes (workers/training/distributed: the data-parallel step
a job takes with AGENT_RFT_TRAINING_PROCESSES=N): seconds per step and peak memory per process,
each configuration in a fresh process so that its memory is its own.

    .venv/bin/python -m benchmarks.training.processes                        # SmolLM2, LoRA, 1 and 2 processes
    .venv/bin/python -m benchmarks.training.processes --mode full
    .venv/bin/python -m benchmarks.training.processes --device cuda --processes 1 2 4 8   # one GPU per process

Prints a table and writes benchmarks/results/training_processes_<mode>.json."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "training_processes_{mode}.json"


def sequences(n: int, prompt_tokens: int, sampled_tokens: int, seed: int = 0) -> list[Any]:
    """`n` rollouts with the shape of an agent's: a long prompt and tool output, fewer sampled tokens."""
    from workers.training.sequences import TrainSequence

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, sampled = prompt_tokens + rng.randint(-16, 16), sampled_tokens + rng.randint(-16, 16)
        ids = [rng.randrange(100, 40000) for _ in range(prompt + sampled)]
        out.append(TrainSequence(ids, [0] * prompt + [1] * sampled, [0.0] * prompt + [-2.0] * sampled,
                                 advantage=(-1) ** i * 0.5))
    return out


class Stepper:
    """The model, optimizer and loss of one job's update, on this rank."""

    def __init__(self, group: Any, options: dict[str, Any]) -> None:
        import torch

        from workers.models.loading import load_model
        from workers.models.lora import training_mode
        from workers.methods.reinforcement.update import LossSettings

        if options["threads"]:
            torch.set_num_threads(options["threads"])
        torch.manual_seed(0)
        self.group, self.options = group, options
        loaded = load_model(options["model"], dtype=options["dtype"], device=options["device"])
        self.model = training_mode(loaded, options["mode"], rank=16, alpha=32)
        self.model.eval()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-5)
        self.settings = LossSettings("grpo", 0.2, 0.0, 1.0, options["sampled_tokens"])

    def step(self, parts: list[list[Any]], n: int) -> dict[str, float]:
        import torch

        from workers.methods.reinforcement.update import policy_update

        started = time.perf_counter()
        stats = policy_update(self.model, self.optimizer, parts[self.group.rank], settings=self.settings,
                              pad_token_id=0, micro_batch_tokens=self.options["micro_batch_tokens"],
                              max_grad_norm=1.0, reference=lambda _batch: None, n_sequences=n,
                              sync_gradients=self.group.all_reduce_gradients)
        if self.options["device"] == "cuda":
            torch.cuda.synchronize()
        mine = {"seconds": time.perf_counter() - started, "loss": stats.loss, "peak_mb": peak_mb(self.options)}
        return self.group.gather(mine)


def peak_mb(options: dict[str, Any]) -> float:
    if options["device"] == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def follow(group: Any, options: dict[str, Any]) -> None:
    import asyncio

    from workers.training.distributed.launch import serve_commands

    asyncio.run(serve_commands(group, Stepper(group, options)))


def one_configuration(options: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 of `options["processes"]`: warm-up, then timed steps over the same sequences."""
    from workers.training.distributed.group import OneProcess, Rendezvous, shares
    from workers.training.distributed.launch import TrainingProcesses, backend_for, free_port

    n = options["processes"]
    processes = None
    group: Any = OneProcess()
    if n > 1:
        rendezvous = Rendezvous(free_port(), n, 600, backend_for(options["device"]))
        processes = TrainingProcesses(rendezvous, follow, options, Path(options["work_dir"]))
        group = processes.join_group()
    try:
        stepper = Stepper(group, options)
        batch = sequences(options["sequences"], options["prompt_tokens"], options["sampled_tokens"])
        parts = shares(batch, n, weight=lambda s: len(s.token_ids))
        runs = []
        for _ in range(1 + options["repeats"]):
            group.command("step", parts, len(batch))
            runs.append(stepper.step(parts, len(batch)))
    finally:
        if processes is not None:
            processes.stop()
    timed = runs[1:]
    return {"processes": n, "seconds_per_step": statistics.median(max(r["seconds"] for r in run) for run in timed),
            "step_seconds": [max(r["seconds"] for r in run) for run in timed],
            "peak_mb_per_process": [max(run[rank]["peak_mb"] for run in runs) for rank in range(n)],
            "loss": timed[-1][0]["loss"]}


def table(results: list[dict[str, Any]], options: dict[str, Any]) -> str:
    base = results[0]["seconds_per_step"]
    lines = [f"One update of {options['model']} ({options['mode']}, {options['dtype']}, {options['device']}): "
             f"{options['sequences']} sequences of ~{options['prompt_tokens']}+{options['sampled_tokens']} tokens; "
             f"median of {options['repeats']} steps",
             "| processes | seconds / step | speed-up vs 1 | peak memory per process (MB) |", "|---|---|---|---|"]
    for r in results:
        memory = ", ".join(f"{m:.0f}" for m in r["peak_mb_per_process"])
        lines.append(f"| {r['processes']} | {r['seconds_per_step']:.2f} | {base / r['seconds_per_step']:.2f}x | "
                     f"{memory} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--sampled-tokens", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one_configuration(json.loads(args.one))), flush=True)
        return
    cores = len(os.sched_getaffinity(0))
    results = []
    for n in args.processes:
        options = {"model": args.model, "mode": args.mode, "dtype": args.dtype, "device": args.device,
                   "processes": n, "sequences": args.sequences, "prompt_tokens": args.prompt_tokens,
                   "sampled_tokens": args.sampled_tokens, "micro_batch_tokens": args.micro_batch_tokens,
                   "repeats": args.repeats, "threads": None if args.device == "cuda" else max(1, cores // n),
                   "work_dir": str(REPO / "benchmarks" / "results" / f"processes-{n}")}
        out = subprocess.run([sys.executable, "-m", "benchmarks.training.processes", "--one", json.dumps(options)],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
        print(f"{n} process(es): {results[-1]['seconds_per_step']:.2f} s/step", flush=True)
    text = table(results, options)
    print(text)
    results_file = Path(str(RESULTS).format(mode=args.mode))
    results_file.parent.mkdir(parents=True, exist_ok=True)
    report = {"options": {k: v for k, v in options.items() if k not in ("processes", "threads", "work_dir")},
              "cores": cores, "results": results, "table": text,
              "date": time.strftime("%Y-%m-%d"), "machine": os.uname().machine}
    results_file.write_text(json.dumps(report, indent=2))
    print(f"wrote {results_file}")


if __name__ == "__main__":
    main()
