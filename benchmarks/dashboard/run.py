"""Dashboard response times on a big job: 500 steps x 64 rollouts x 5 tool calls.

Seeds a fresh PostgreSQL database (bulk COPY) with one job of that size: its per-step metrics
(job_steps, job_metrics, metrics events), 32,000 rollout records with 5 tool calls and their
outputs each, checkpoints. Serves the real app under uvicorn on 127.0.0.1, logs in to the
dashboard and times repeated requests of the job page, its chart data, and rollout-browser pages
with each filter, against a baseline measured in the same run (`/healthz`, the cheapest route).
Target: p95 under 300 ms for every dashboard request.

    .venv/bin/python benchmarks/dashboard/run.py [--steps 500] [--rollouts 64] [--calls 5] [--repeat 40]
    .venv/bin/python benchmarks/dashboard/run.py --serve   # keep the server up to look at it

Needs PostgreSQL on 127.0.0.1:5432 (AGENT_RFT_TEST_PG). Prints a table and writes
benchmarks/results/dashboard.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg.types.json import Jsonb

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.auth.service import create_project  # noqa: E402
from app.core.config import Settings  # noqa: E402
from app.core.db import make_engine, make_session_factory  # noqa: E402
from app.core.migrations import upgrade  # noqa: E402
from app.jobs.worker_service import flatten_metrics  # noqa: E402
from app.main import create_app  # noqa: E402
from tests.conftest import fresh_pg_database, serve_app  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "dashboard.json"
TARGET_MS = 300.0
TOOLS = ("search", "list", "cat")
FINISH = ("answered", "answered", "answered", "tool_budget", "token_cap", "parse_error")
BATCH = 8  # prompts per step; rollouts per step / BATCH = group size


def tool_mix(step: int, steps: int) -> list[float]:
    """Shares of search / list / cat: the policy moves from searching to listing and reading."""
    t = step / steps
    search = 0.8 - 0.6 * t
    return [search, (1 - search) * 0.4, (1 - search) * 0.6]


def step_metrics(step: int, steps: int, rng: random.Random) -> dict[str, Any]:
    mix = tool_mix(step, steps)
    calls = 5.0 - 2.0 * step / steps + rng.uniform(-0.2, 0.2)
    reward = min(1.0, 0.15 + 0.7 * step / steps + rng.uniform(-0.05, 0.05))
    eval_step = step % 25 == 0 or step == steps
    scores: dict[str, Any] = {"train_reward_mean": reward,
                              "train_sub_rewards": {"answer": reward, "efficiency": 1 - calls / 10}}
    if eval_step:
        scores["valid_reward_mean"] = reward - 0.05
        scores["valid_sub_rewards"] = {"answer": reward - 0.05, "efficiency": 1 - calls / 10}
    return {
        "step": step, "total_steps": steps, "scores": scores,
        "usage": {"completion_tokens": 64 * 180, "tool_output_tokens": 64 * 900, "prompt_tokens": 64 * 120},
        "errors": {"tool_failures": rng.randint(0, 2), "grader_failures": 0, "parse_errors": rng.randint(0, 5)},
        "timing": {"step": {"sampling": 20 + rng.random(), "grading": 2 + rng.random(), "training": 15 + rng.random(),
                            "eval": 10.0 if eval_step else 0.0, "full_iteration": 48 + rng.random()}},
        "tools": {
            "rollouts": 64, "tool_calls_per_rollout": calls,
            "tool_calls_per_rollout_by_tool": {name: calls * share for name, share in zip(TOOLS, mix)},
            "tool_latency_s_mean_by_tool": {name: 0.05 + 0.1 * i + rng.random() * 0.02 for i, name in enumerate(TOOLS)},
            "tool_error_rate_by_tool": {name: rng.uniform(0, 0.05) for name in TOOLS},
            "completion_tokens_per_rollout": 180 + rng.uniform(-10, 10),
            "tool_output_tokens_per_rollout": 900 + rng.uniform(-50, 50),
            "wall_time_s_mean": 4 + rng.random(), "wall_time_s_max": 9 + rng.random(),
            "parse_errors_per_rollout": 0.1 * rng.random(),
            "finish_reasons": {"answered": 0.8, "tool_budget": 0.15, "token_cap": 0.05},
            "budget_exhausted_rate": 0.15 * (1 - step / steps), "parse_error_rate": 0.05 * rng.random(),
        },
        "train": {"loss": rng.uniform(-0.1, 0.1), "kl": 0.001 * step / steps, "grad_norm": rng.uniform(0.1, 1),
                  "learning_rate": 1e-5, "frac_reward_zero_std": max(0.0, 0.6 - 0.4 * step / steps),
                  "rollouts_used": 60, "rollouts_excluded": 1},
    }


def rollout_record(step: int, index: int, calls: int, rng: random.Random) -> dict[str, Any]:
    trace_id = f"trace_{step:04d}_{index:03d}_{rng.getrandbits(32):08x}"
    sample = (step * BATCH + index // (64 // BATCH)) % 400
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer questions about annual reports. Use the tools."},
        {"role": "user", "content": f"What was ACME's revenue in {2000 + sample % 25}, in $M?"},
    ]
    tool_calls = []
    mix = tool_mix(step, 500)
    for turn in range(1, calls + 1):
        name = rng.choices(TOOLS, weights=mix)[0]
        call_id = f"call_{rng.getrandbits(48):012x}"
        arguments = json.dumps({"query": f"revenue {2000 + turn}"} if name == "search" else {"path": f"acme/{2000 + turn}.md"})
        messages.append({"role": "assistant", "content": f"<tool_call>{{\"name\": \"{name}\", \"arguments\": {arguments}}}</tool_call>"})
        output = f"{name} results for turn {turn}: " + " ".join(f"ACME line {i}: revenue {100 + i}.5" for i in range(12))
        messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": output})
        tool_calls.append({"call_id": call_id, "name": name, "arguments": arguments, "status": "ok", "status_code": 200,
                           "latency_s": 0.05 + rng.random() * 0.1, "bytes": len(output), "error": None,
                           "truncated": False, "turn": turn})
    answer = f"The revenue was {100 + sample % 50}.5 million."
    messages.append({"role": "assistant", "content": answer})
    reward = round(rng.random(), 3)
    return {"trace_id": trace_id, "sample_index": sample, "messages": messages, "tool_calls": tool_calls,
            "prompt_tokens": 120, "completion_tokens": 180, "tool_output_tokens": 900, "turns": calls + 1,
            "parse_errors": 0, "wall_time_s": 4 + rng.random(), "finish_reason": rng.choice(FINISH),
            "final_answer": answer, "reward": reward, "advantage": reward - 0.5, "excluded": None,
            "grader_errors": [], "grader_details": None, "sub_rewards": {"answer": reward, "efficiency": 0.5}}


def seed(url: str, *, steps: int, rollouts: int, calls: int) -> tuple[str, str]:
    """One project with one finished job of the given size; returns (api key, job id)."""
    engine = make_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with make_session_factory(engine).begin() as session:
        created = create_project(session=session, name="bench")
    engine.dispose()
    job_id = "ftjob-benchmarkdashboard000001"
    rng = random.Random(7)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    method = {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "multi", "name": "answer_and_efficiency", "calculate_output": "0.8 * answer + 0.2 * efficiency",
                   "graders": {"answer": {"type": "string_check", "name": "answer", "input": "{{sample.output_text}}",
                                          "reference": "{{item.reference_answer}}", "operation": "eq"},
                               "efficiency": {"type": "python", "name": "efficiency", "source": "def grade(s, i): return 1.0"}}},
        "tools": [{"name": t, "server_url": f"https://tools.example.com/{t}", "headers": {"Authorization": "****3456"}}
                  for t in TOOLS],
        "hyperparameters": {"batch_size": BATCH, "n_epochs": 10, "compute_multiplier": 2, "eval_interval": 25,
                            "eval_samples": 32, "learning_rate_multiplier": "auto", "reasoning_effort": "default"},
        "max_episode_steps": 10, "x_open_model": {"training_mode": "lora", "lora_rank": 16}}}
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO jobs (id, project_id, model, training_file, status, method, seed, result_files, created_at,"
            " finished_at, completed_steps, fine_tuned_model) VALUES (%s, %s, 'SmolLM2-135M-Instruct', 'file-bench',"
            " 'succeeded', %s, 7, '[]', %s, %s, %s, %s)",
            (job_id, created.project_id, Jsonb(method), start, start + timedelta(hours=steps // 60), steps,
             f"ft:SmolLM2-135M-Instruct:bench::{job_id}"))
        with conn.cursor() as cur:
            all_metrics = [step_metrics(step, steps, rng) for step in range(1, steps + 1)]
            with cur.copy("COPY job_steps (job_id, step, data, created_at) FROM STDIN") as copy:
                for step, data in enumerate(all_metrics, start=1):
                    copy.write_row((job_id, step, Jsonb(data), start + timedelta(minutes=step)))
            with cur.copy("COPY job_metrics (job_id, step, key, value) FROM STDIN") as copy:
                for step, data in enumerate(all_metrics, start=1):
                    for key, value in flatten_metrics(data).items():
                        if key not in ("step", "total_steps"):
                            copy.write_row((job_id, step, key, value))
            with cur.copy("COPY job_events (id, job_id, created_at, level, type, message, data) FROM STDIN") as copy:
                for step, data in enumerate(all_metrics, start=1):
                    copy.write_row((f"ftevent-bench{step:07d}", job_id, start + timedelta(minutes=step), "info", "metrics",
                                    f"Step {step}/{steps}: train reward {data['scores']['train_reward_mean']:.3f}", Jsonb(data)))
            with cur.copy("COPY job_rollouts (job_id, step, split, trace_id, sample_index, reward, finish_reason,"
                          " tool_calls, data, created_at) FROM STDIN") as copy:
                for step in range(1, steps + 1):
                    for index in range(rollouts):
                        record = rollout_record(step, index, calls, rng)
                        copy.write_row((job_id, step, "train", record["trace_id"], record["sample_index"], record["reward"],
                                        record["finish_reason"], len(record["tool_calls"]), Jsonb(record),
                                        start + timedelta(minutes=step)))
            for step in (steps - 75, steps - 50, steps - 25, steps):
                cur.execute("INSERT INTO checkpoints (id, job_id, step_number, fine_tuned_model_checkpoint, metrics,"
                            " created_at) VALUES (%s, %s, %s, %s, %s, %s)",
                            (f"ftckpt_bench{step:05d}", job_id, step, f"ft:SmolLM2-135M-Instruct:bench::{job_id}:ckpt-step-{step}",
                             Jsonb({"step": step, "valid_reward_mean": 0.8}), start + timedelta(minutes=step)))
        conn.execute("ANALYZE")
    return created.secret, job_id


def login(client: httpx.Client, key: str) -> None:
    page = client.get("/dashboard/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    response = client.post("/dashboard/login", data={"api_key": key, "csrf_token": csrf, "next": "/dashboard/jobs"})
    assert response.status_code == 303, response.text


def timed(client: httpx.Client, path: str, repeat: int) -> dict[str, float]:
    for _ in range(3):  # warm-up: caches, connection pool, plan cache
        assert client.get(path).status_code == 200, path
    samples = []
    for _ in range(repeat):
        began = time.perf_counter()
        response = client.get(path)
        samples.append((time.perf_counter() - began) * 1000)
        assert response.status_code == 200, (path, response.status_code)
    samples.sort()
    return {"p50_ms": statistics.median(samples), "p95_ms": samples[max(0, math.ceil(0.95 * len(samples)) - 1)],
            "max_ms": samples[-1], "bytes": len(response.content)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--serve", action="store_true", help="keep serving after the measurements (Ctrl-C ends)")
    args = parser.parse_args()

    with fresh_pg_database() as url:
        upgrade(url.replace("postgresql://", "postgresql+psycopg://"))
        began = time.perf_counter()
        key, job_id = seed(url, steps=args.steps, rollouts=args.rollouts, calls=args.calls)
        seeded_s = time.perf_counter() - began
        print(f"seeded {args.steps} steps x {args.rollouts} rollouts x {args.calls} tool calls in {seeded_s:.1f} s")
        settings = Settings(_env_file=None, database_url=url, data_dir=REPO / ".agent-rft-bench",
                            broker_url="redis://127.0.0.1:6379/15", watchdog_interval_s=3600)
        with serve_app(create_app(settings)) as port, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, follow_redirects=False) as client:
            login(client, key)
            middle = args.steps // 2
            anchor = client.get(f"/dashboard/jobs/{job_id}/rollouts", params={"step": middle}).text
            after = re.findall(r"/rollouts/(trace_[0-9a-f_]+)\"", anchor)[-1]
            job = f"/dashboard/jobs/{job_id}"
            cases = [
                ("baseline: GET /healthz", "/healthz"),
                ("jobs list", "/dashboard/jobs"),
                ("job page (HTML)", job),
                ("chart data, all steps", f"{job}/data"),
                ("chart data, a poll (new steps only)", f"{job}/data?after_step={args.steps - 1}"),
                ("rollouts: first page", f"{job}/rollouts"),
                ("rollouts: a page deep in the job", f"{job}/rollouts?after={after}"),
                ("rollouts: step filter", f"{job}/rollouts?step={middle}"),
                ("rollouts: sample filter", f"{job}/rollouts?sample=7"),
                ("rollouts: reward range + finish reason", f"{job}/rollouts?reward_min=0.9&reward_max=1&finish_reason=token_cap"),
                ("rollouts: tool used (rarest early on)", f"{job}/rollouts?tool=list&step=1"),
                ("rollouts: tool used, all steps", f"{job}/rollouts?tool=cat"),
                ("rollout transcript", f"{job}/rollouts/{after}"),
            ]
            rows = []
            for name, path in cases:
                rows.append({"name": name, "path": path, **timed(client, path, args.repeat)})
            baseline = rows[0]["p95_ms"]
            print(f"\n{'request':42} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'x base':>7} {'KiB':>7}  <300ms p95")
            for row in rows:
                row["p95_vs_baseline"] = row["p95_ms"] / baseline if baseline else None
                row["meets_target"] = row["p95_ms"] < TARGET_MS
                print(f"{row['name']:42} {row['p50_ms']:8.1f} {row['p95_ms']:8.1f} {row['max_ms']:8.1f} "
                      f"{row['p95_vs_baseline']:7.1f} {row['bytes'] / 1024:7.1f}  {'yes' if row['meets_target'] else 'NO'}")
            result = {"steps": args.steps, "rollouts_per_step": args.rollouts, "tool_calls_per_rollout": args.calls,
                      "rollout_rows": args.steps * args.rollouts, "seed_seconds": seeded_s, "repeat": args.repeat,
                      "target_p95_ms": TARGET_MS, "all_meet_target": all(r["meets_target"] for r in rows[1:]),
                      "requests": rows}
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(result, indent=2))
            print(f"\nwrote {RESULTS}")
            if args.serve:
                print(f"\nserving http://127.0.0.1:{port}/dashboard/jobs  (API key {key}); Ctrl-C ends")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass


if __name__ == "__main__":
    main()
