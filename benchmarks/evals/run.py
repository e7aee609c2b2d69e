"""Items per second of an eval run (`/v1/evals`, on a worker) against the demo's old evaluation
path (`agent-rft eval` in a child process), on the demo's held-out questions, in the same run.

Set up once, as the demo does (examples/financial_reports/demo.py), on the embedded default in a
temporary data directory: the demo's data (its held-out questions), the example tool server on
its corpus, the API (`agent-rft serve`) and one worker (`agent-rft worker`) as child processes, a
project key, the held-out file uploaded with the `openai` SDK, an eval whose one testing
criterion is the demo's CORRECT_ANSWER (numeric_match). Then, `--repeats` times, both paths on
the same model, file, tools and criterion, in alternating order:

- old: `agent-rft eval` with the arguments the demo gave it, timed from its start to its exit
  (process start, imports, model load, rollouts, grading, report);
- new: `client.evals.runs.create` with the reinforcement job's sampling (temperature, token caps,
  tool budget, tools), timed from the create call to the run's `completed` status (the worker is
  up and idle; its start is not counted, its model load for the run is). An untimed one-item
  run first warms the worker up: a fresh worker's first task imports torch and transformers.

    .venv/bin/python -m benchmarks.evals.run [--repeats 3] [--model SmolLM2-135M-Instruct]
    .venv/bin/python -m benchmarks.evals.run --quick --repeats 1      # tiny model, 2 items: a smoke run

Prints a table and writes benchmarks/results/evals.json (every repeat). Every child process is
stopped at the end, also on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "evals.json"
POLL_S = 0.2  # the new path's status polling: its timing's resolution


class Failed(Exception):
    """The benchmark cannot go on; the message says why."""


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {"cpu": model, "cpu_count": os.cpu_count(), "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


# --- set-up -------------------------------------------------------------------------------------------


def write_data(cfg: Any, workdir: Path, tools_url: str) -> dict[str, Path]:
    """The demo's held-out questions (as make_data writes them), its tools JSON and the grader JSON."""
    from examples.financial_reports import demo_task
    from examples.financial_reports.corpus import write_jsonl
    from examples.financial_reports.demo import job_tools
    from examples.financial_reports.demo_config import CORRECT_ANSWER

    data = workdir / "data"
    corpus, _train, held_out = demo_task.build(
        data, seed=cfg.seed, companies=cfg.companies, years=cfg.years, held_out_companies=cfg.held_out_companies,
        system_prompt=cfg.system_prompt)
    held_out = held_out[: cfg.held_out_rows]
    paths = {"corpus": corpus, "held_out": data / "held-out.jsonl", "tools": workdir / "tools.json",
             "grader": workdir / "correct-answer.json"}
    write_jsonl(paths["held_out"], held_out)
    paths["tools"].write_text(json.dumps(job_tools(tools_url), indent=2))
    paths["grader"].write_text(json.dumps(CORRECT_ANSWER))
    return paths


def start_services(children: Any, cfg: Any, ports: dict[str, int], corpus: Path) -> None:
    """The tool server, the API and one worker, each in its own process group, as the demo starts them."""
    from examples.financial_reports.demo import cli_argv, http_ok, wait_until

    services = [
        ("tools", [sys.executable, "-m", "examples.financial_reports.server", "--corpus", str(corpus),
                   "--port", str(ports["tools"])], f"http://127.0.0.1:{ports['tools']}/healthz"),
        ("api", cli_argv("serve", "--host", "127.0.0.1", "--port", str(ports["api"])),
         f"http://127.0.0.1:{ports['api']}/healthz"),
    ]
    for name, argv, _ in services:
        children.start(name, argv)
    worker = children.start("worker", cli_argv("worker", "--loglevel", "info"))
    for name, _, health in services:
        wait_until(lambda url=health: http_ok(url), f"the {name} server ({health})", cfg.startup_timeout_s, children)
    wait_until(lambda: "ready" in worker.tail(100_000), "the worker", cfg.startup_timeout_s, children)


def create_eval(client: Any) -> str:
    from examples.financial_reports.demo_config import CORRECT_ANSWER

    created = client.evals.create(
        name="benchmark: demo held-out questions",
        data_source_config={"type": "custom", "item_schema": {"type": "object"}, "include_sample_schema": False},
        testing_criteria=[CORRECT_ANSWER])
    return created.id


# --- the two paths ------------------------------------------------------------------------------------


def old_argv(cfg: Any, model: str, dtype: str, paths: dict[str, Path], out: Path) -> list[str]:
    """`agent-rft eval` as the demo ran it (its `evaluate`), the temperature from the reinforcement
    job's x_open_model (the demo's eval temperature was the same 0.7)."""
    from examples.financial_reports.demo import cli_argv

    x = cfg.x_open_model
    return cli_argv("eval", "--model", model, "--data", str(paths["held_out"]), "--tools", str(paths["tools"]),
                    "--grader", str(paths["grader"]), "--n", str(cfg.eval_rollouts_per_row),
                    "--temperature", str(x.get("temperature", 0.7)), "--max-episode-steps", str(cfg.tool_budget),
                    "--max-tokens-per-turn", str(x.get("max_tokens_per_turn", 256)),
                    "--max-tokens-per-rollout", str(x.get("max_tokens_per_rollout", 2048)), "--dtype", dtype,
                    "--json", str(out))


def run_old(children: Any, cfg: Any, model: str, dtype: str, paths: dict[str, Path], repeat: int) -> dict[str, Any]:
    from examples.financial_reports.demo import _stop_groups

    name, out = f"eval-old-{repeat}", children.workdir / f"eval-old-{repeat}.json"
    started = time.perf_counter()
    child = children.start(name, old_argv(cfg, model, dtype, paths, out))
    try:
        child.proc.wait(timeout=cfg.job_timeout_s)
    except subprocess.TimeoutExpired:
        raise Failed(f"`agent-rft eval` took over {cfg.job_timeout_s:.0f} s; end of {child.log}:\n{child.tail()}") \
            from None
    seconds = time.perf_counter() - started
    _stop_groups([children.running.pop(name)])  # anything the eval left in its group
    if child.proc.returncode != 0 or not out.is_file():
        raise Failed(f"`agent-rft eval` exited with status {child.proc.returncode}; end of {child.log}:\n{child.tail()}")
    report = json.loads(out.read_text())
    rollouts = report["rollouts"]
    passed = sum(1 for r in rollouts if r["passed"])
    return {"seconds": seconds, "items": len(rollouts), "passed": passed, "errored": report["accuracy"]["grader_errors"],
            "pass_rate": report["accuracy"]["pass_rate"], "mean_reward": report["accuracy"]["mean_reward"],
            "rollout_wall_s_max": report["summary"].get("wall_time_s_max"),
            "tool_calls_per_item": report["summary"].get("tool_calls_per_rollout"),
            "completion_tokens_per_item": report["summary"].get("completion_tokens_per_rollout"),
            "prompt_tokens_per_item": sum(r.get("prompt_tokens", 0) for r in rollouts) / len(rollouts)}


def new_data_source(cfg: Any, model: str, dtype: str, file_id: str, tools_url: str) -> dict[str, Any]:
    """What `agent-rft compare` gives a run of the reinforcement job (app/evals/from_job.py): its
    sampling, token caps, tool budget and tools."""
    from examples.financial_reports.demo import job_tools

    x = cfg.x_open_model
    agent = {"tools": job_tools(tools_url), "max_episode_steps": cfg.tool_budget,
             "samples_per_item": cfg.eval_rollouts_per_row, "dtype": dtype}
    if x.get("max_tokens_per_rollout"):
        agent["max_tokens_per_rollout"] = x["max_tokens_per_rollout"]
    return {"type": "completions", "model": model, "source": {"type": "file_id", "id": file_id},
            "input_messages": {"type": "item_reference", "item_reference": "item.messages"},
            "sampling_params": {"temperature": x.get("temperature", 1.0),
                                "max_completion_tokens": x.get("max_tokens_per_turn", 256), "seed": cfg.seed},
            "x_open_model": agent}


def run_new(children: Any, client: Any, cfg: Any, eval_id: str, data_source: dict[str, Any],
            repeat: int) -> dict[str, Any]:
    worker = children.running["worker"]
    started = time.perf_counter()
    name = f"benchmark repeat {repeat + 1}" if repeat >= 0 else "benchmark warm-up"
    run = client.evals.runs.create(eval_id, name=name, data_source=data_source)
    deadline = time.monotonic() + cfg.job_timeout_s
    while run.status not in ("completed", "failed", "canceled"):
        children.check_alive()
        if time.monotonic() > deadline:
            raise Failed(f"eval run {run.id} took over {cfg.job_timeout_s:.0f} s (status {run.status}); "
                         f"end of {worker.log}:\n{worker.tail()}")
        time.sleep(POLL_S)
        run = client.evals.runs.retrieve(run.id, eval_id=eval_id)
    seconds = time.perf_counter() - started
    if run.status != "completed":
        error = f": {run.error.code}: {run.error.message}" if run.error else ""
        raise Failed(f"eval run {run.id} ended {run.status}{error}; end of {worker.log}:\n{worker.tail()}")
    counts = run.result_counts
    items = counts.total
    trajectories = [(o.model_extra or {}).get("x_trajectory") or {}
                    for o in client.evals.runs.output_items.list(run.id, eval_id=eval_id, limit=100)]
    usage = run.per_model_usage[0] if run.per_model_usage else None
    return {"seconds": seconds, "run_id": run.id, "items": items,
            "items_total": (run.model_extra or {}).get("x_items_total"),
            "passed": counts.passed, "failed": counts.failed, "errored": counts.errored,
            "pass_rate": counts.passed / items if items else 0.0,
            "rollout_wall_s_max": max((t.get("wall_time_s") or 0.0 for t in trajectories), default=None),
            "tool_calls_per_item": sum(len(t.get("tool_calls") or []) for t in trajectories) / items if items else None,
            "completion_tokens_per_item": usage.completion_tokens / items if usage and items else None,
            "prompt_tokens_per_item": usage.prompt_tokens / items if usage and items else None}


# --- the table ------------------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = statistics.median(r["seconds"] for r in runs)
    items = runs[0]["items"]
    passed, total = sum(r["passed"] for r in runs), sum(r["items"] for r in runs)
    rollouts = [r["rollout_wall_s_max"] for r in runs if r.get("rollout_wall_s_max") is not None]
    calls = [r["tool_calls_per_item"] for r in runs if r.get("tool_calls_per_item") is not None]
    return {"median_seconds": seconds, "items": items, "items_per_s": items / seconds if seconds else 0.0,
            "pass_rate": passed / total if total else 0.0, "seconds": [r["seconds"] for r in runs],
            "pass_rates": [r["pass_rate"] for r in runs],
            "rollouts_median_s": statistics.median(rollouts) if rollouts else None,
            "tool_calls_per_item": statistics.mean(calls) if calls else None}


def table(result: dict[str, Any]) -> str:
    old, new = result["summary"]["old"], result["summary"]["new"]
    ratio = new["items_per_s"] / old["items_per_s"] if old["items_per_s"] else float("nan")
    lines = [f"{result['model']} ({result['dtype']}), {old['items']} held-out items, median of {result['repeats']} "
             f"repeat(s), {result['machine']['cpu_count']} CPU(s): {result['machine']['cpu']}",
             "| path | median s | items/s | new/old items/s | pass rate | tool calls / item | "
             "of which rollouts (s) | seconds per repeat |",
             "|---|---|---|---|---|---|---|---|"]
    for label, row, r in (("old: agent-rft eval (child process)", old, "1.00x"),
                          ("new: eval run on the worker", new, f"{ratio:.2f}x")):
        runs = ", ".join(f"{s:.1f}" for s in row["seconds"])
        calls, rollouts = row["tool_calls_per_item"], row["rollouts_median_s"]
        lines.append(f"| {label} | {row['median_seconds']:.1f} | {row['items_per_s']:.3f} | {r} | "
                     f"{row['pass_rate']:.0%} | {'-' if calls is None else format(calls, '.2f')} | "
                     f"{'-' if rollouts is None else format(rollouts, '.1f')} | {runs} |")
    lines.append("(rollouts: the longest rollout's wall time; the items run as one batch, so the rest of a path's "
                 "seconds is start, imports, model load, grading and reporting)")
    return "\n".join(lines)


# --- the whole run --------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import openai

    from examples.financial_reports import demo_config
    from examples.financial_reports.demo import Children, child_env, create_project, free_port

    cfg = demo_config.QUICK if args.quick else demo_config.DEMO
    if args.model:
        cfg = replace(cfg, model=args.model)
    dtype = demo_config.dtype(cfg)
    ports = {name: free_port() for name in ("api", "tools", "inference")}
    api_url, tools_url = f"http://127.0.0.1:{ports['api']}", f"http://127.0.0.1:{ports['tools']}"
    env = child_env(workdir, api_url, inference_url=f"http://127.0.0.1:{ports['inference']}", model=cfg.model,
                    dtype=dtype)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    children = Children(workdir, env)
    result: dict[str, Any] = {"date": date.today().isoformat(), "model": cfg.model, "dtype": dtype,
                              "quick": args.quick, "repeats": args.repeats, "machine": machine(), "workdir": str(workdir)}
    try:
        print(f"set-up in {workdir}: data, tool server, API, worker ({cfg.model}, {dtype})", flush=True)
        began = time.perf_counter()
        paths = write_data(cfg, workdir, tools_url)
        key = create_project(workdir)
        start_services(children, cfg, ports, paths["corpus"])
        client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=2)
        with paths["held_out"].open("rb") as fh:
            file_id = client.files.create(file=(paths["held_out"].name, fh), purpose="fine-tune").id
        eval_id = create_eval(client)
        data_source = new_data_source(cfg, cfg.model, dtype, file_id, tools_url)
        result["setup_seconds"] = round(time.perf_counter() - began, 1)
        if not args.no_warmup:
            # The worker's first task imports the model stack (torch, transformers): part of its start,
            # which a worker that has served before has behind it. One item, untimed.
            first = json.loads(paths["held_out"].read_text().splitlines()[0])
            warmup = {**data_source, "source": {"type": "file_content", "content": [{"item": first}]}}
            result["warmup"] = run_new(children, client, cfg, eval_id, warmup, -1)
            print(f"worker warm-up (one item, not counted): {result['warmup']['seconds']:.1f} s", flush=True)
        result["config"] = {"held_out_rows": cfg.held_out_rows, "samples_per_item": cfg.eval_rollouts_per_row,
                            "tool_budget": cfg.tool_budget, "x_open_model": cfg.x_open_model,
                            "old_argv": old_argv(cfg, cfg.model, dtype, paths, workdir / "eval-old-N.json")[1:],
                            "new_data_source": {**data_source, "x_open_model": {
                                **data_source["x_open_model"], "tools": [t["name"] for t in data_source["x_open_model"]["tools"]]}}}
        runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for repeat in range(args.repeats):
            order = ("old", "new") if repeat % 2 == 0 else ("new", "old")  # alternate: neither always goes first
            for path in order:
                if path == "old":
                    measured = run_old(children, cfg, cfg.model, dtype, paths, repeat)
                else:
                    measured = run_new(children, client, cfg, eval_id, data_source, repeat)
                measured.update(repeat=repeat, position=order.index(path))
                runs[path].append(measured)
                print(f"repeat {repeat + 1}/{args.repeats} {path}: {measured['seconds']:.1f} s for "
                      f"{measured['items']} items, {measured['passed']} passed", flush=True)
        if runs["old"][0]["items"] != runs["new"][0]["items"]:
            raise Failed(f"the paths ran different items: old {runs['old'][0]['items']}, new {runs['new'][0]['items']}")
        result["runs"] = runs
        result["summary"] = {path: summarize(r) for path, r in runs.items()}
        return result
    finally:
        # A second Ctrl-C while stopping must not leave children behind.
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        children.stop_all()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="default: the demo's (examples/financial_reports/demo_config.py)")
    parser.add_argument("--quick", action="store_true", help="the demo's QUICK config: tiny-smollm2, 2 items")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no untimed one-item eval run before the first timed one (the worker's first imports)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data directory (logs, reports)")
    args = parser.parse_args(argv)
    # openai's SDK marks client.evals deprecated (OpenAI's hosted service); this service implements it.
    warnings.filterwarnings("ignore", message="The Evals API is deprecated", category=DeprecationWarning)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Both set here: a process started in the background by a script inherits SIGINT ignored.
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    workdir = Path(tempfile.mkdtemp(prefix="agent-rft-bench-evals-"))
    code = 1
    try:
        result = measure(args, workdir)
        print("\n" + table(result))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {RESULTS.relative_to(REPO)}")
        code = 0
    except KeyboardInterrupt as exc:
        print(f"\ninterrupted ({exc or 'SIGINT'}); all processes stopped", file=sys.stderr)
        code = 130
    except Exception as exc:  # noqa: BLE001 - any failure: say why, after every child is stopped
        reason = str(exc) if isinstance(exc, Failed) else f"{type(exc).__name__}: {exc}"
        print(f"\nbenchmark failed: {reason}\n(logs kept in {workdir / 'logs'})", file=sys.stderr)
        args.keep = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
