"""`agent-rft demo --quick`, as a user runs it: a subprocess that starts the API, a worker, the
inference server, the example tool and grader servers, writes browsing traces, trains a tiny
starting agent with a supervised job and continues it with a reinforcement job from its `ft:`
model, calls the trained model through /v1/chat/completions, ends with `agent-rft compare` (eval
runs of the base model, the starting agent and the trained agent on the worker) and stops every
process it started; and Ctrl-C in the middle stops everything."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import wait_for
from workers.models.loading import native_bf16_cpu

AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
DEMO = [AGENT_RFT, "demo", "--quick"]


def env_without_settings() -> dict[str, str]:
    # The demo must not need (or pick up) the suite's PostgreSQL and Redis settings.
    return {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RFT_")}


def leftover_processes(workdir: Path) -> list[str]:
    """Processes still alive that the demo started: by the pids it recorded, and any process
    whose environment points at its data directory (grandchildren included)."""
    pids = set(json.loads((workdir / "pids.json").read_text()).values())
    marker = f"AGENT_RFT_DATA_DIR={workdir}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.add(int(entry.name))
            except OSError:
                continue  # gone, or not ours to read
    return [f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()!r}" for pid in sorted(pids) if alive(pid)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_quick_demo_runs_both_jobs_and_compares_the_stages(tmp_path):
    workdir = tmp_path / "demo"
    result = subprocess.run([*DEMO, "--workdir", str(workdir)], env=env_without_settings(), capture_output=True,
                            text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for line in ("browsing traces", "supervised job", "train loss", "reinforcement job", "train reward",
                 "mean reward ± std", "pass rate: correct", "tool calls per item", "tokens per item",
                 "seconds per item", "improved reward & fewer tools", "/dashboard/jobs/", "/dashboard/evals/",
                 "client.chat.completions.create(", "agent-rft inference", "demo succeeded"):
        assert line in result.stdout, output[-4000:]

    report = json.loads((workdir / "demo-report.json").read_text())
    assert report["outcome"] == "succeeded" and report["failed_stage"] is None
    # The starting agent is a supervised job on the traces; the reinforcement job starts from its ft: model.
    assert report["traces"]["rows"] == report["data"]["trace_questions"] and report["traces"]["calls_per_trace"] >= 1
    starting, rft = report["starting_agent"], report["rft"]
    assert starting["status"] == "succeeded" and starting["fine_tuned_model"].startswith("ft:tiny-smollm2")
    assert rft["status"] == "succeeded" and rft["model"] == starting["fine_tuned_model"]
    assert rft["fine_tuned_model"].startswith("ft:tiny-smollm2") and rft["fine_tuned_model"] != starting["fine_tuned_model"]
    # The comparison: an eval run per model, each over every held-out question, in the table's order.
    comparison = report["comparison"]
    runs = comparison["runs"]
    assert [r["model"] for r in runs] == ["tiny-smollm2", starting["fine_tuned_model"], rft["fine_tuned_model"]]
    assert all(r["status"] == "completed" and r["items"] == report["data"]["held_out_rows"] for r in runs), runs
    assert comparison["criteria"] == ["correct and efficient", "correct"]
    assert all(0 <= r["pass_rate_by_criterion"]["correct"] <= 1 for r in runs)
    table = result.stdout[result.stdout.index("mean reward ± std"):]
    assert f"{runs[-1]['mean_reward']:.3f}" in table.splitlines()[0]  # the table is the eval runs' figures
    assert oct((workdir / "api-key").stat().st_mode & 0o777) == "0o600"
    assert (workdir / "api-key").read_text().startswith("sk-")
    assert (Path(report["checkpoint"]) / "adapter_config.json").is_file()
    # The trained model answered through /v1/chat/completions (API + the demo's inference server).
    serving = report["serving"]
    assert serving["model"] == rft["fine_tuned_model"] and serving["turns"]
    assert serving["turns"][0]["usage"]["completion_tokens"] > 0
    assert "inference" in json.loads((workdir / "pids.json").read_text())
    assert report["wall_time_s"] < 300
    assert leftover_processes(workdir) == []
    # Precision: bfloat16 where this CPU computes it natively, for both jobs (and the eval runs, which take the job's).
    assert report["dtype"] == ("bfloat16" if native_bf16_cpu() else "float32")
    assert f"in {report['dtype']}" in result.stdout.splitlines()[0]
    with sqlite3.connect(workdir / "agent_rft.sqlite3") as db:
        methods = [json.loads(m) for (m,) in db.execute("SELECT method FROM jobs ORDER BY created_at")]
    assert [m["type"] for m in methods] == ["supervised", "reinforcement"]
    assert all(m[m["type"]]["x_open_model"]["dtype"] == report["dtype"] for m in methods)
    assert methods[1]["reinforcement"]["grader"]["type"] == "endpoint"


def test_ctrl_c_stops_the_demo_and_every_process_it_started(tmp_path):
    workdir = tmp_path / "demo"
    log = tmp_path / "demo.log"
    with log.open("w") as out:
        demo = subprocess.Popen([*DEMO, "--workdir", str(workdir)], env=env_without_settings(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Mid-run: every service has been started.
        wait_for(lambda: (workdir / "pids.json").is_file() and "worker" in (workdir / "pids.json").read_text()
                 or demo.poll() is not None, timeout=120, interval=0.2)
        assert demo.poll() is None, log.read_text()
        demo.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = demo.wait(timeout=30)
        assert time.monotonic() - started < 30
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert code != 0
    assert "interrupted (SIGINT)" in log.read_text()
    assert leftover_processes(workdir) == []
    assert json.loads((workdir / "demo-report.json").read_text())["failed_stage"]


def test_a_directory_the_demo_did_not_make_is_never_wiped(tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    result = subprocess.run([*DEMO, "--workdir", str(tmp_path)], env=env_without_settings(), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "was not made by the demo" in result.stderr
    assert precious.read_text() == "keep me"
