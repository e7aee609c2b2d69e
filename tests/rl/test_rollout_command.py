"""`agent-rft rollout` as a user runs it: a real model, a real tool server, transcripts and a table."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.rl.tool_server import tool_server

AGENT_RFT = str(Path(sys.executable).parent / "agent-rft")
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the reports",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGENT_RFT_OUTBOUND_ALLOWLIST": "127.0.0.1", "AGENT_RFT_DATA_DIR": str(tmp_path / "d")}
    return subprocess.run([AGENT_RFT, "rollout", *args], env=env, capture_output=True, text=True, timeout=300)


def test_rollout_prints_transcripts_and_a_summary(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Revenue of ACME in {y}?"}],
                                          "tools": [SEARCH], "answer": "1"}) for y in (2021, 2022)) + "\n")
    with tool_server() as (url, _):
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps([{"name": "search", "server_url": url}]))
        out = tmp_path / "out.json"
        result = run(["--model", "tiny-smollm2", "--data", str(data), "--tools", str(tools), "--n", "2",
                      "--max-tokens-per-turn", "16", "--max-tokens-per-rollout", "32", "--json", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("=== rollout") == 4
    assert "[user] Revenue of ACME in 2021?" in result.stdout
    for label in ("tool calls per rollout", "completion tokens per rollout", "finish reasons"):
        assert label in result.stdout
    written = json.loads(out.read_text())
    assert written["summary"]["rollouts"] == 4 and len(written["rollouts"]) == 4
    assert {r["sample_index"] for r in written["rollouts"]} == {0, 1}
    assert len({r["trace_id"] for r in written["rollouts"]}) == 4


def test_rollout_reports_bad_input_clearly(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "search", "server_url": "http://127.0.0.1:9/tools"}]))
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n{broken\n")
    bad_line = run(["--model", "tiny-smollm2", "--data", str(data), "--tools", str(tools)], tmp_path)
    assert bad_line.returncode == 1 and "line 2" in bad_line.stderr
    tools.write_text("{}")
    bad_tools = run(["--model", "tiny-smollm2", "--data", str(data), "--tools", str(tools)], tmp_path)
    assert bad_tools.returncode == 1 and "expected a JSON list" in bad_tools.stderr
    tools.write_text(json.dumps([{"name": "search", "server_url": "http://127.0.0.1:9/tools"}]))
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    unknown = run(["--model", "no-such-model", "--data", str(data), "--tools", str(tools)], tmp_path)
    assert unknown.returncode == 1 and "no-such-model" in unknown.stderr
