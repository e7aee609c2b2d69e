"""Asynchronous validation of training files: every row checked, first errors with line
numbers on the failed job, bounded memory on a 100 MB file."""

import json
import subprocess
import sys
import textwrap

from tests.conftest import job_body, jsonl, question_rows, wait_for


def run_job(api, content: bytes, **overrides):  # noqa: ANN001, ANN201
    file_id = api.upload_ok(content)
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, **overrides)).json()["id"]
    return wait_for(lambda: (j := api.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] != "validating_files" and j)


def test_valid_file_moves_to_queued_with_row_count_event(api):
    job = run_job(api, jsonl(question_rows(7)))
    assert job["status"] == "queued" and job["error"] is None
    events = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]]
    assert any("7 rows" in m for m in events)


def test_bad_rows_fail_the_job_with_line_numbers(api):
    good = question_rows(1)[0]
    lines = [
        json.dumps(good),                                                     # 1 ok
        "{not json",                                                          # 2
        json.dumps({"prompt": "no messages"}),                                # 3
        json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),       # 4
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),  # 5
        "",                                                                   # 6 blank: ignored
        json.dumps({**good, "tools": [{"type": "function", "function": {"name": "cat"}}]}),  # 7 undeclared tool
        json.dumps({**good, "tools": [{"type": "function", "function": {"name": "search",
                                                                         "parameters": {"type": "object", "properties": 5}}}]}),  # 8
        json.dumps([1, 2]),                                                   # 9
    ]
    job = run_job(api, ("\n".join(lines) + "\n").encode())
    assert job["status"] == "failed" and isinstance(job["finished_at"], int)
    error = job["error"]
    assert error["code"] == "invalid_json" and error["param"] == "training_file"
    message = error["message"]
    assert "7 invalid lines" in message
    for fragment in ("line 2: not valid JSON", "line 3: the row has no 'messages'", "line 4: messages[0].role",
                     "line 5: the last message must have role 'user'", "line 7: tools[0] names 'cat'"):
        assert fragment in message, message
    assert "and 2 more invalid lines" in message  # the first five are shown, the rest counted
    events = api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]
    assert events[0]["level"] == "error" and events[0]["message"].startswith("Validation failed")


def test_each_row_problem_is_named(api):
    cases = {
        "invalid_tools": {"messages": [{"role": "user", "content": "q"}],
                          "tools": [{"type": "function", "function": {"name": "search",
                                                                      "parameters": {"type": "object", "properties": 5}}}]},
        "invalid_content": {"messages": [{"role": "user", "content": 5}]},
        "missing_messages": {"messages": []},
        "undeclared_tool": {"messages": [{"role": "user", "content": "q"}],
                            "tools": [{"type": "function", "function": {"name": "list"}}]},
    }
    for code, row in cases.items():
        job = run_job(api, jsonl([row]))
        assert job["status"] == "failed" and job["error"]["code"] == code, (code, job["error"])
        assert job["error"]["message"].count("line 1:") == 1


def test_too_few_rows(client, app, project):
    from tests.conftest import Api

    app.state.settings.min_training_rows = 10
    api = Api(client, project["key"])
    job = run_job(api, jsonl(question_rows(3)))
    assert job["status"] == "failed" and job["error"]["code"] == "too_few_rows"
    assert "3 rows; at least 10" in job["error"]["message"]


def test_validation_file_is_checked_too(api):
    train = api.upload_ok(question_rows(3))
    bad = api.upload_ok(b'{"messages": [{"role": "user", "content": "q"}]}\n{oops\n')
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(train, validation_file=bad)).json()["id"]
    job = wait_for(lambda: (j := api.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] != "validating_files" and j)
    assert job["status"] == "failed" and job["error"]["param"] == "validation_file"
    assert "line 2" in job["error"]["message"]


def test_job_tools_from_the_job_declare_what_rows_may_use(api):
    rows = question_rows(2)
    for row in rows:
        row["tools"].append({"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}})
    tools = [{"name": "search", "server_url": "http://127.0.0.1:8765/tools"},
             {"name": "cat", "server_url": "http://127.0.0.1:8765/tools"}]
    assert run_job(api, jsonl(rows), reinforcement={"tools": tools})["status"] == "queued"


def test_a_100_mb_file_validates_in_bounded_memory(tmp_path):
    """Validation streams: peak memory stays far below the file's size."""
    path = tmp_path / "big.jsonl"
    row = json.dumps({**question_rows(1)[0], "context": "x" * 900}).encode() + b"\n"
    with path.open("wb") as fh:
        chunk = row * 1000
        while fh.tell() < 100 * 1024 * 1024:
            fh.write(chunk)
    script = textwrap.dedent(f"""
        import resource
        from app.jobs.validation import validate_jsonl
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open({str(path)!r}, "rb") as fh:
            report = validate_jsonl(fh, declared_tools={{"search"}})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(report.rows, report.error_count, before, after)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    rows, errors, before_kb, after_kb = map(int, out.stdout.split())
    assert rows == path.stat().st_size // len(row) and errors == 0
    assert after_kb - before_kb < 20 * 1024, f"validation grew the process by {(after_kb - before_kb) // 1024} MB"
