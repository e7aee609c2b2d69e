"""Grader throughput: string_check, numeric_match and text_similarity over 10,000 samples, and
the endpoint grader against a local server that answers after 50 ms, at concurrency 1 vs 32.

Baselines measured in the same run: a bare Python `==` loop for string_check (what the
engine's per-sample overhead costs) and concurrency 1 for the endpoint grader.

    .venv/bin/python benchmarks/graders/run.py [--samples 10000] [--endpoint-samples 200]

Prints a table and writes benchmarks/results/graders.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from pydantic import TypeAdapter

from agent_rft.graders.batch import grade_many
from agent_rft.graders.core import GraderContext, Sample
from agent_rft.graders.schemas import Grader

RESULTS = Path(__file__).resolve().parents[1] / "results" / "graders.json"
GRADER = TypeAdapter(Grader)


def finance_samples(n: int) -> list[tuple[Sample, dict, str]]:
    rng = random.Random(7)
    rows = []
    for i in range(n):
        value = round(rng.uniform(1, 5000), 1)
        answer = rng.choice([f"${value:,}", f"{value} million", f"The revenue was {value}.", f"({value})", str(value)])
        reference = {"answer": str(value), "text": f"Revenue grew to {value} million in {2000 + i % 25}."}
        rows.append((Sample.from_model_sample(f"{answer} Revenue grew in {2000 + i % 25}."), reference, f"trace_{i}"))
    return rows


def measure(config: dict, jobs: list, *, concurrency: int = 32) -> dict:
    grader = GRADER.validate_python(config)
    ctx = GraderContext(outbound_allowlist=["127.0.0.1"])
    started = time.perf_counter()
    results = asyncio.run(grade_many(grader, jobs, ctx, concurrency=concurrency))
    elapsed = time.perf_counter() - started
    failed = sum(r.failed for r in results)
    return {"samples": len(jobs), "seconds": round(elapsed, 3), "samples_per_s": round(len(jobs) / elapsed, 1),
            "failed": failed, "mean_reward": round(sum(r.reward for r in results) / len(results), 4)}


def baseline_equality(jobs: list) -> dict:
    started = time.perf_counter()
    matches = sum(sample.output_text == item["answer"] for sample, item, _ in jobs)
    elapsed = time.perf_counter() - started
    return {"samples": len(jobs), "seconds": round(elapsed, 4), "samples_per_s": round(len(jobs) / elapsed, 1),
            "matches": matches}


def slow_grader_server(latency_s: float) -> tuple[str, uvicorn.Server]:
    app = FastAPI()

    @app.post("/grade")
    async def grade(body: dict) -> dict:
        await asyncio.sleep(latency_s)
        return {"score": 1.0 if body["item"]["answer"] in body["sample"]["output_text"] else 0.0}

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", backlog=256))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/grade", server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--endpoint-samples", type=int, default=200)
    args = parser.parse_args()

    jobs = finance_samples(args.samples)
    template = {"input": "{{sample.output_text}}"}
    rows = {
        "baseline: python == loop": baseline_equality(jobs),
        "string_check (ilike)": measure({"type": "string_check", "name": "s", "reference": "{{item.answer}}",
                                         "operation": "ilike", **template}, jobs),
        "numeric_match": measure({"type": "numeric_match", "name": "n", "reference": "{{item.answer}}", **template}, jobs),
        "text_similarity fuzzy_match": measure({"type": "text_similarity", "name": "f", "reference": "{{item.text}}",
                                                "evaluation_metric": "fuzzy_match", **template}, jobs),
        "text_similarity rouge_l": measure({"type": "text_similarity", "name": "r", "reference": "{{item.text}}",
                                            "evaluation_metric": "rouge_l", **template}, jobs),
        "text_similarity bleu": measure({"type": "text_similarity", "name": "b", "reference": "{{item.text}}",
                                         "evaluation_metric": "bleu", **template}, jobs),
    }
    url, server = slow_grader_server(0.05)
    endpoint = {"type": "endpoint", "name": "e", "url": url}
    few = jobs[: args.endpoint_samples]
    rows["endpoint 50 ms, concurrency 1"] = measure(endpoint, few, concurrency=1)
    rows["endpoint 50 ms, concurrency 32"] = measure(endpoint, few, concurrency=32)
    server.should_exit = True

    base = rows["baseline: python == loop"]["samples_per_s"]
    for name, row in rows.items():
        if name.startswith(("string_check", "numeric", "text_")):
            row["slowdown_vs_bare_loop"] = round(base / row["samples_per_s"], 1)
    speedup = rows["endpoint 50 ms, concurrency 32"]["samples_per_s"] / rows["endpoint 50 ms, concurrency 1"]["samples_per_s"]
    rows["endpoint 50 ms, concurrency 32"]["speedup_vs_concurrency_1"] = round(speedup, 1)

    print(f"{'grader':34} {'samples':>8} {'seconds':>9} {'samples/s':>11} {'failed':>7}  ratio")
    for name, row in rows.items():
        ratio = row.get("slowdown_vs_bare_loop") or row.get("speedup_vs_concurrency_1") or ""
        label = "x slower than bare loop" if "slowdown_vs_bare_loop" in row else "x faster than concurrency 1" if ratio else ""
        print(f"{name:34} {row['samples']:>8} {row['seconds']:>9} {row['samples_per_s']:>11} {row.get('failed', 0):>7}  {ratio} {label}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
