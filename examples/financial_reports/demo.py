"""`agent-rft demo`: Agent RFT's lesson, end to end, on the embedded default. A starting agent that
over-browses a tree of annual reports (search, list, cat; 10 calls at most) is made by a supervised
job on a scripted browsing policy's traces; a reinforcement job from its `ft:` model, graded on the
right answer and charged for every tool call and token, teaches it to go straight to the answer.

Every part runs as it would for a user: the API (`agent-rft serve`), a training worker
(`agent-rft worker`), the inference server, the example tool server and grader server are
separate processes on free 127.0.0.1 ports sharing one data directory (SQLite, embedded broker);
the demo drives the API with the official `openai` SDK and ends with `agent-rft compare`: an eval
run of the base model, the starting agent and the trained agent on companies never trained on,
on the worker with the job's tools and grader. All values come from
examples/financial_reports/demo_config.py.

The demo process itself never imports torch: models load in the worker and the inference server,
which the demo can stop at any moment. Children run in their own sessions; on success, failure,
Ctrl-C, SIGTERM or an exhausted time budget every child's process group is terminated, then
killed after a grace period, and the demo exits 0 only if every stage passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai

from examples.financial_reports import demo_config
from examples.financial_reports.demo_config import DemoConfig

REPO = Path(__file__).resolve().parents[2]  # the repository root
MARKER = ".agent-rft-demo"  # written into the workdir: only a directory holding it is ever wiped
GRACE_S = 5.0  # SIGTERM to SIGKILL
POLL_S = 1.0
EXIT_FAILED, EXIT_BUDGET, EXIT_INTERRUPTED = 1, 124, 130


class StageFailed(Exception):
    """A stage could not complete; the message says why (with a log tail where one helps)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM. A KeyboardInterrupt, so that nothing on the way up swallows it."""


class BudgetExceeded(KeyboardInterrupt):
    """The demo's time budget ran out (SIGALRM)."""


# --- child processes --------------------------------------------------------------------------------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 2500) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


@dataclass
class Children:
    """The demo's processes, each leading its own process group, recorded in `pids.json`."""

    workdir: Path
    env: dict[str, str]
    running: dict[str, Child] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)  # every child ever started: name -> pid

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """`env`: added to the demo's environment for this child only (a secret stays off its command line)."""
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            # Own session: a terminal's Ctrl-C reaches the demo only, which then stops the groups in order.
            proc = subprocess.Popen(argv, env={**self.env, **(env or {})}, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.running[name] = child = Child(name, proc, log)
        self.started[name] = proc.pid
        # Every pid, also of children already stopped: what a test (or a user) checks for leftovers.
        (self.workdir / "pids.json").write_text(json.dumps(self.started, indent=2))
        return child

    def check_alive(self) -> None:
        for child in self.running.values():
            if child.proc.poll() is not None:
                raise StageFailed(f"{child.name} exited with status {child.proc.returncode}; "
                                  f"end of {child.log}:\n{child.tail()}")

    def stop_all(self) -> None:
        _stop_groups(list(self.running.values()))
        self.running.clear()


def _stop_groups(children: list[Child]) -> None:
    """SIGTERM every group, wait up to GRACE_S for all, SIGKILL the rest (a Celery worker's warm
    shutdown would otherwise finish its training step first)."""
    for child in children:
        _signal_group(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        _signal_group(child.proc.pid, signal.SIGKILL)  # also reaps what a leader left behind in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=GRACE_S)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(ready: Callable[[], Any], what: str, timeout: float, children: Children) -> Any:
    """Poll `ready` until truthy; fail when a child dies meanwhile or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        children.check_alive()
        result = ready()
        if result:
            return result
        if time.monotonic() > deadline:
            raise StageFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


# --- the run ----------------------------------------------------------------------------------------


@dataclass
class Demo:
    config: DemoConfig
    workdir: Path
    children: Children
    ports: dict[str, int]
    dtype: str = "float32"  # demo_config.dtype(config): both jobs' x_open_model.dtype (the eval runs take the job's)
    api_key: str = ""  # the demo project's key, once created
    started: float = field(default_factory=time.monotonic)
    stage: str = "setup"
    timings: dict[str, float] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.stage = name
        print(f"\n== {name}", flush=True)
        began = time.monotonic()
        yield
        self.timings[name] = round(time.monotonic() - began, 1)

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service]}"


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


def cli_argv(*args: str) -> list[str]:
    return python_argv("-m", "app.cli", *args)


def prepare_workdir(workdir: Path) -> Path:
    """Wipe the demo's previous run, refusing any directory the demo did not create."""
    workdir = workdir.expanduser().resolve()
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).is_file():
        raise StageFailed(f"{workdir} is not empty and was not made by the demo; pass another --workdir")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / MARKER).write_text("made by `agent-rft demo`; wiped at its next start\n")
    return workdir


def child_env(workdir: Path, api_url: str, *, inference_url: str, model: str, dtype: str) -> dict[str, str]:
    # No inherited AGENT_RFT_* setting may point the demo at another database or broker.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RFT_")}
    env.update({"AGENT_RFT_DATA_DIR": str(workdir), "AGENT_RFT_OUTBOUND_ALLOWLIST": "127.0.0.1",
                "AGENT_RFT_API_URL": api_url, "AGENT_RFT_WORKER_TOKEN": secrets.token_urlsafe(32),
                # The inference server serves the demo's base model in the precision it was trained in.
                "AGENT_RFT_INFERENCE_URL": inference_url, "AGENT_RFT_INFERENCE_MODELS": model,
                "AGENT_RFT_INFERENCE_DTYPE": dtype,
                "AGENT_RFT_AUTO_MIGRATE": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    return env


# --- stage 1: data ----------------------------------------------------------------------------------


def make_data(demo: Demo) -> dict[str, Path]:
    from examples.financial_reports import demo_task
    from examples.financial_reports.corpus import write_jsonl

    cfg, data = demo.config, demo.workdir / "data"
    corpus, train, held_out = demo_task.build(
        data, seed=cfg.seed, companies=cfg.companies, years=cfg.years, held_out_companies=cfg.held_out_companies,
        system_prompt=cfg.system_prompt)
    held_out = held_out[: cfg.held_out_rows]
    trace_rows, rft_rows = demo_task.split_by_company(train, cfg.rft_companies)
    rft_train, n_epochs = size_training(rft_rows, cfg.steps, cfg.hyperparameters["batch_size"])
    paths = {"corpus": corpus, "questions": data / "trace-questions.jsonl", "train": data / "rft-train.jsonl",
             "held_out": data / "held-out.jsonl", "traces": data / "sft-traces.jsonl"}
    write_jsonl(paths["questions"], trace_rows)
    write_jsonl(paths["train"], rft_train)
    write_jsonl(paths["held_out"], held_out)
    demo.report["data"] = {"documents": sum(1 for _ in corpus.rglob("*.md")), "trace_questions": len(trace_rows),
                           "rft_rows": len(rft_train), "held_out_rows": len(held_out), "n_epochs": n_epochs}
    companies = cfg.companies - cfg.held_out_companies
    print(f"{demo.report['data']['documents']} reports of {cfg.companies} companies: {len(trace_rows)} questions about "
          f"{companies - cfg.rft_companies} companies for the starting agent's traces, {len(rft_rows)} about "
          f"{cfg.rft_companies} others for reinforcement, {len(held_out)} held-out questions about "
          f"{cfg.held_out_companies} more, in {data}")
    return paths


def size_training(rows: list[dict[str, Any]], steps: int, batch_size: int) -> tuple[list[dict[str, Any]], int]:
    """Rows for exactly `steps` steps of one epoch: the first steps x batch_size rows, the rows
    repeated in order when there are fewer (as the benchmark's second epoch repeats them)."""
    wanted = steps * batch_size
    return [rows[i % len(rows)] for i in range(wanted)], 1


# --- stage 2: services ------------------------------------------------------------------------------


def start_services(demo: Demo, corpus: Path) -> None:
    cfg, children = demo.config, demo.children
    api, tools, grader = demo.url("api"), demo.url("tools"), demo.url("grader")
    services = [
        ("api", cli_argv("serve", "--host", "127.0.0.1", "--port", str(demo.ports["api"])), f"{api}/healthz"),
        ("inference", cli_argv("inference", "--host", "127.0.0.1", "--port", str(demo.ports["inference"])),
         f"{demo.url('inference')}/healthz"),
        ("tools", python_argv("-m", "examples.financial_reports.server", "--corpus", str(corpus),
                              "--port", str(demo.ports["tools"])), f"{tools}/healthz"),
        ("grader", python_argv("-m", "examples.financial_reports.grader_server", "--tool-server", tools,
                               "--port", str(demo.ports["grader"]), *cfg.charges.flags()), f"{grader}/healthz"),
    ]
    for name, argv, _ in services:
        children.start(name, argv)
    worker = children.start("worker", cli_argv("worker", "--loglevel", "info"))
    for name, _, health in services:
        wait_until(lambda url=health: http_ok(url), f"the {name} server ({health})", cfg.startup_timeout_s, children)
        print(f"{name:9} ready at {demo.url(name)}  (log: {children.running[name].log})")
    wait_until(lambda: "ready" in worker.tail(100_000), "the worker", cfg.startup_timeout_s, children)
    print(f"worker    ready  (log: {worker.log})")


def create_project(workdir: Path) -> str:
    from app.auth.service import create_project as create
    from app.core.config import Settings
    from app.core.db import make_engine, make_session_factory
    from app.core.migrations import upgrade

    settings = Settings(_env_file=None, data_dir=workdir, database_url=None, broker_url=None)
    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine).begin() as session:
        key = create(session=session, name="demo").secret
    engine.dispose()
    return key


# --- stages 3-7: upload, evaluate, train --------------------------------------------------------------


def job_tools(tools_url: str) -> list[dict[str, Any]]:
    from examples.financial_reports.server import TOOL_SCHEMAS

    return [{"name": s["function"]["name"], "server_url": f"{tools_url}/tools",
             "description": s["function"]["description"], "parameters": s["function"]["parameters"]}
            for s in TOOL_SCHEMAS]


def write_traces(demo: Demo, paths: dict[str, Path]) -> None:
    """The starting agent's training file: the scripted browsing policy's traces against the demo's
    own tool server (examples/financial_reports/traces.py), one chat row per trace."""
    import asyncio

    from examples.financial_reports.corpus import write_jsonl
    from examples.financial_reports.traces import browsing_traces, tool_calls_of
    from workers.engine.tools_client import ToolClient

    cfg = demo.config
    rows = [json.loads(line) for line in paths["questions"].read_text().splitlines()]

    async def traces() -> list[dict[str, Any]]:
        async with ToolClient(job_tools(demo.url("tools")), allowlist=["127.0.0.1"]) as client:
            return await browsing_traces(rows, client, seed=cfg.seed, per_row=cfg.traces_per_question,
                                         cat_limit=cfg.cat_limit)

    written = asyncio.run(traces())
    write_jsonl(paths["traces"], written)
    calls = [tool_calls_of(trace) for trace in written]
    demo.report["traces"] = {"rows": len(written), "calls_per_trace": sum(calls) / len(calls)}
    print(f"{len(written)} browsing traces, {min(calls)} to {max(calls)} tool calls each "
          f"({sum(calls) / len(calls):.1f} on average), in {paths['traces']}")


def upload(client: openai.OpenAI, paths: dict[str, Path]) -> dict[str, str]:
    ids = {}
    for key in ("traces", "train", "held_out"):
        with paths[key].open("rb") as fh:
            uploaded = client.files.create(file=(paths[key].name, fh), purpose="fine-tune")
        ids[key] = uploaded.id
        print(f"uploaded {paths[key].name}: {uploaded.id} ({uploaded.bytes} bytes)")
    return ids


def compare(demo: Demo, job: Any, held_out_file: str, paths: dict[str, Path]) -> dict[str, Any]:
    """`agent-rft compare` on the reinforcement job, in a child process the demo can stop at any
    time: an eval of the base model, the starting agent (the job's start) and the trained agent on
    the held-out questions, each a rollout with the job's tools, graded by the job's grader and by
    whether the answer is right; the workers run it as they run jobs."""
    cfg, out = demo.config, demo.workdir / "comparison.json"
    base = ["--model", cfg.model] if cfg.evaluate_base else []
    argv = cli_argv("compare", job.id, "--file", held_out_file, *base, "--criterion", str(paths["grader"]),
                    "--samples", str(cfg.eval_rollouts_per_row), "--timeout", str(cfg.job_timeout_s),
                    "--json", str(out), "--base-url", f"{demo.url('api')}/v1")
    child = demo.children.start("compare", argv, env={"AGENT_RFT_API_KEY": demo.api_key})
    while child.proc.poll() is None:
        demo.children.check_alive()
        time.sleep(0.2)
    demo.children.running.pop(child.name)
    if child.proc.returncode != 0 or not out.is_file():
        raise StageFailed(f"`agent-rft compare` exited with status {child.proc.returncode}:\n{child.tail()}")
    print(child.tail(100_000).rstrip())
    return json.loads(out.read_text())


def call_tool(demo: Demo, call: Any, item: dict[str, Any]) -> str:
    """Run a tool call of the served model against the demo's tool server (docs/tool-server.md), as
    a user's own agent loop would."""
    body = {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "trace_id": f"trace_demo_{secrets.token_hex(8)}", "item": item}
    answer = httpx.post(f"{demo.url('tools')}/tools", json=body, timeout=30)
    return str(answer.json().get("output", "")) if answer.status_code < 500 else f"tool error {answer.status_code}"


def use_trained_model(demo: Demo, client: openai.OpenAI, model: str, paths: dict[str, Path]) -> dict[str, Any]:
    """Ask the trained model a held-out question through /v1/chat/completions, run its tool calls and
    send the results back until it answers, as training's episodes did (the same tool budget, the
    same notice once it is spent); print the snippet that asks the same."""
    from examples.financial_reports.server import TOOL_SCHEMAS  # the job's tools, in OpenAI's format
    from workers.engine.prompting import budget_spent_message

    row = json.loads(paths["held_out"].read_text().splitlines()[0])
    item = {k: v for k, v in row.items() if k not in ("messages", "tools")}
    messages, tools, budget = list(row["messages"]), row.get("tools") or TOOL_SCHEMAS, demo.config.tool_budget
    tools_file = demo.workdir / "chat-tools.json"
    tools_file.write_text(json.dumps(tools, indent=2))
    print(openai_snippet(demo, model, row["messages"][-1]["content"], tools_file))
    started, turns = time.monotonic(), []
    for turn in range(budget + 1):
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="auto" if turn < budget else "none",
            temperature=0, max_tokens=int(demo.config.x_open_model.get("max_tokens_per_turn", 256)))
        message = answer.choices[0].message
        turns.append({"finish_reason": answer.choices[0].finish_reason, "content": message.content,
                      "tool_calls": [c.model_dump() for c in message.tool_calls or []], "usage": answer.usage.model_dump()})
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            print(f"  → {call.function.name}({call.function.arguments})")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": call_tool(demo, call, item)})
        if turn + 1 == budget:
            messages.append({"role": "user", "content": budget_spent_message(row["messages"])})
    final = turns[-1]
    print(f"  answer ({final['finish_reason']}): {(final['content'] or '').strip()[:300]!r}")
    print(f"  expected: {item.get('answer')}; {len(turns)} chat completion(s), {time.monotonic() - started:.1f} s")
    if not final["content"] and not final["tool_calls"]:  # what the model wrote, not a failure of the service
        print(f"  {model} answered with an empty message")
    return {"model": model, "question": row["messages"][-1]["content"], "turns": turns, "expected": item.get("answer")}


def openai_snippet(demo: Demo, model: str, question: str, tools_file: Path) -> str:
    return (f"Ready to paste while the demo's services run (`openai` SDK):\n\n"
            f"  import json\n"
            f"  from openai import OpenAI\n"
            f"  client = OpenAI(base_url=\"{demo.url('api')}/v1\", api_key=open(\"{demo.workdir / 'api-key'}\").read().strip())\n"
            f"  answer = client.chat.completions.create(\n"
            f"      model=\"{model}\",\n"
            f"      messages=[{{\"role\": \"system\", \"content\": {json.dumps(demo.config.system_prompt)}}},\n"
            f"                {{\"role\": \"user\", \"content\": {json.dumps(question)}}}],\n"
            f"      tools=json.load(open(\"{tools_file}\")), temperature=0)\n"
            f"  print(answer.choices[0].message)\n")


def supervised_method(demo: Demo) -> dict[str, Any]:
    cfg = demo.config
    return {"type": "supervised", "supervised": {
        "hyperparameters": cfg.sft_hyperparameters, "x_open_model": {**cfg.sft_x_open_model, "dtype": demo.dtype}}}


def reinforcement_method(demo: Demo) -> dict[str, Any]:
    """The endpoint grader (the right number x the efficiency of finding it) and the demo's tools."""
    cfg = demo.config
    hyperparameters = {**cfg.hyperparameters, "n_epochs": demo.report["data"]["n_epochs"]}
    return {"type": "reinforcement", "reinforcement": {
        "grader": demo_config.grader_spec(demo.url("grader")), "tools": job_tools(demo.url("tools")),
        "max_episode_steps": cfg.tool_budget, "hyperparameters": hyperparameters,
        "x_open_model": {**cfg.x_open_model, "dtype": demo.dtype}}}


def train(demo: Demo, client: openai.OpenAI, *, label: str, model: str, training_file: str,
          method: dict[str, Any]) -> Any:
    """Create a job through the SDK, print where to watch it, follow it to the end: the job, succeeded."""
    cfg = demo.config
    created = client.fine_tuning.jobs.create(
        model=model, training_file=training_file, seed=cfg.seed, suffix=label,
        metadata={"demo": "financial-reports", "stage": label}, method=method)
    block = method[method["type"]]
    print(f"created {method['type']} job {created.id} from {model} ({block['hyperparameters']})")
    print(f"watch it live: {demo.url('api')}/dashboard/jobs/{created.id}  (log in with the demo's API key, in "
          f"{demo.workdir / 'api-key'})", flush=True)
    job = follow_job(demo, client, created.id)
    demo.report[label] = {"id": job.id, "status": job.status, "model": model, "fine_tuned_model": job.fine_tuned_model,
                          "error": job.error.model_dump() if job.error and job.error.message else None}
    if job.status != "succeeded":
        error = f": {job.error.code}: {job.error.message}" if job.error and job.error.message else ""
        raise StageFailed(f"the {label} job ended {job.status}{error}\nend of the worker log:\n"
                          f"{demo.children.running['worker'].tail()}")
    print(f"succeeded: {job.fine_tuned_model}")
    return job


def follow_job(demo: Demo, client: openai.OpenAI, job_id: str) -> Any:
    """Poll until the job is final, printing one line per training step."""
    from app.cli_client import FINAL_STATUSES, metrics_events, summarize_metrics

    seen: set[int] = set()
    status = None
    deadline = time.monotonic() + demo.config.job_timeout_s
    while True:
        demo.children.check_alive()
        job = client.fine_tuning.jobs.retrieve(job_id)
        for event in metrics_events(client, job_id):  # read after the job: a final job's steps are all in
            if event.data.get("step") not in seen:
                seen.add(event.data.get("step"))
                print(f"  {summarize_metrics(event.data)}", flush=True)
        if job.status != status:
            status = job.status
            print(f"job {status}", flush=True)
        if job.status in FINAL_STATUSES:
            return job
        if time.monotonic() > deadline:
            raise StageFailed(f"training did not finish within {demo.config.job_timeout_s:.0f} s")
        time.sleep(POLL_S)


def final_checkpoint(workdir: Path, job_id: str) -> Path:
    """The latest step-N the worker saved (docs/training.md: `<checkpoint dir>/<job>/checkpoints/step-N`)."""
    root = workdir / "checkpoints" / job_id / "checkpoints"
    steps = [p for p in root.glob("step-*") if p.name.removeprefix("step-").isdigit() and p.is_dir()]
    if not steps:
        raise StageFailed(f"the job succeeded but no checkpoint is under {root}")
    return max(steps, key=lambda p: int(p.name.removeprefix("step-")))


# --- the whole demo ---------------------------------------------------------------------------------


def stages(demo: Demo) -> None:
    cfg = demo.config
    with demo.step("1/8 data: synthetic annual reports and questions"):
        paths = make_data(demo)
        paths["tools"] = demo.workdir / "tools.json"
        paths["tools"].write_text(json.dumps(job_tools(demo.url("tools")), indent=2))
        paths["grader"] = demo.workdir / "correct-answer.json"  # what the comparison counts as correct
        paths["grader"].write_text(json.dumps(demo_config.CORRECT_ANSWER))
    with demo.step("2/8 services: API, worker, inference, tool server, grader"):
        key = create_project(demo.workdir)
        key_file = demo.workdir / "api-key"
        key_file.touch(mode=0o600)
        key_file.write_text(key + "\n")
        demo.api_key = key
        start_services(demo, paths["corpus"])
    client = openai.OpenAI(base_url=f"{demo.url('api')}/v1", api_key=key, max_retries=2)
    with demo.step("3/8 browsing traces: a scripted, wasteful policy against the tool server"):
        write_traces(demo, paths)
    with demo.step("4/8 upload (openai SDK)"):
        files = upload(client, paths)
    with demo.step("5/8 the starting agent: supervised fine-tuning on the traces"):
        starting = train(demo, client, label="starting_agent", model=cfg.model, training_file=files["traces"],
                         method=supervised_method(demo))
    with demo.step("6/8 reinforcement fine-tuning from the starting agent's ft: model"):
        job = train(demo, client, label="rft", model=starting.fine_tuned_model, training_file=files["train"],
                    method=reinforcement_method(demo))
        demo.report["checkpoint"] = str(final_checkpoint(demo.workdir, job.id))
    with demo.step("7/8 use the trained agent (chat completions, openai SDK)"):
        demo.report["serving"] = use_trained_model(demo, client, job.fine_tuned_model, paths)
    with demo.step("8/8 which model to ship: agent-rft compare on held-out companies"):
        demo.report["comparison"] = compare(demo, job, files["held_out"], paths)
        dashboard = f"{demo.url('api')}/dashboard"
        print(f"\nThe run is kept in {demo.workdir}. To browse it on the dashboard (reward curves, the tool-call mix "
              f"step by step, rollout transcripts) and call the trained model once the demo has stopped:\n"
              f"  export AGENT_RFT_DATA_DIR={demo.workdir} AGENT_RFT_INFERENCE_MODELS={cfg.model} "
              f"AGENT_RFT_INFERENCE_DTYPE={demo.dtype}\n"
              f"  agent-rft serve --port {demo.ports['api']} & agent-rft inference &   # the API, and the "
              f"trained model behind /v1/chat/completions\n"
              f"  then open {dashboard}/jobs/{job.id} and log in with the key in {demo.workdir / 'api-key'}")


def install_signal_handlers(budget_s: float) -> dict[int, Any]:
    def interrupted(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    def out_of_time(_signum: int, _frame: Any) -> None:
        raise BudgetExceeded(f"the demo's time budget of {budget_s:.0f} s ran out")

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    return previous


def restore_signal_handlers(previous: dict[int, Any]) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def run_demo(*, model: str | None = None, steps: int | None = None, quick: bool = False,
             workdir: Path = Path(".agent-rft-demo"), seed: int | None = None) -> int:
    base = demo_config.QUICK if quick else demo_config.DEMO
    config = replace(base, **{k: v for k, v in (("model", model), ("steps", steps), ("seed", seed)) if v is not None})
    if config.steps < 1:
        print(f"demo failed at setup: --steps must be at least 1, got {config.steps}", file=sys.stderr)
        return EXIT_FAILED
    try:
        workdir = prepare_workdir(workdir)
    except (StageFailed, OSError) as exc:
        print(f"demo failed at setup: {exc}", file=sys.stderr)
        return EXIT_FAILED
    ports = {name: free_port() for name in ("api", "inference", "tools", "grader")}
    precision = demo_config.dtype(config)
    env = child_env(workdir, f"http://127.0.0.1:{ports['api']}", inference_url=f"http://127.0.0.1:{ports['inference']}",
                    model=config.model, dtype=precision)
    demo = Demo(config, workdir, Children(workdir, env), ports, precision)
    print(f"agent-rft demo: {config.model} in {demo.dtype}: a starting agent by supervised fine-tuning, then "
          f"{config.steps} reinforcement steps; budget {config.time_budget_s / 60:.0f} min, everything in {workdir}")
    previous = install_signal_handlers(config.time_budget_s)
    code, outcome = EXIT_FAILED, "failed"
    try:
        stages(demo)
        code, outcome = 0, "succeeded"
    except BudgetExceeded as exc:
        code, outcome = EXIT_BUDGET, f"stopped at stage '{demo.stage}': {exc}"
    except Interrupted as exc:
        code, outcome = EXIT_INTERRUPTED, f"interrupted ({exc}) at stage '{demo.stage}'"
    except Exception as exc:  # noqa: BLE001 - any failure ends the demo the same way: its stage, cleanup, status 1
        reason = str(exc) if isinstance(exc, StageFailed) else f"{type(exc).__name__}: {exc}"
        outcome = f"failed at stage '{demo.stage}': {reason}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # A second Ctrl-C while stopping must not leave children behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        demo.children.stop_all()
        restore_signal_handlers(previous)
    wall = time.monotonic() - demo.started
    write_report(demo, outcome, wall)
    stream = sys.stdout if code == 0 else sys.stderr
    print(f"\ndemo {outcome} in {wall:.0f} s; all processes stopped; report: {workdir / 'demo-report.json'}",
          file=stream, flush=True)
    return code


def write_report(demo: Demo, outcome: str, wall: float) -> None:
    report = {"outcome": outcome, "failed_stage": None if outcome == "succeeded" else demo.stage,
              "wall_time_s": round(wall, 1), "stage_seconds": demo.timings, "config": asdict(demo.config), "dtype": demo.dtype,
              "api_url": demo.url("api"), "docs_url": f"{demo.url('api')}/docs",
              "dashboard_url": f"{demo.url('api')}/dashboard", **demo.report}
    with contextlib.suppress(OSError):
        (demo.workdir / "demo-report.json").write_text(json.dumps(report, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    """`python -m examples.financial_reports.demo`: the same run as `agent-rft demo`, with the same options."""
    import argparse

    parser = argparse.ArgumentParser(prog="agent-rft demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help=f"model to train (default {demo_config.DEMO.model})")
    parser.add_argument("--steps", type=int, help=f"reinforcement steps (default {demo_config.DEMO.steps})")
    parser.add_argument("--quick", action="store_true", help="a tiny model and one step per job: a smoke run in minutes")
    parser.add_argument("--workdir", type=Path, default=Path(".agent-rft-demo"), help="wiped at start")
    parser.add_argument("--seed", type=int, help="data and training seed")
    args = parser.parse_args(argv)
    return run_demo(model=args.model, steps=args.steps, quick=args.quick, workdir=args.workdir, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
