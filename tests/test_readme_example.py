"""The README's `openai` SDK example, extracted from README.md and run as written against the live
stack: the API, a real Celery worker, a real tool server and the inference server. Only what a
reader fills in is replaced (the URL, the key, the file, the tool server), plus the model: the tiny
one, so that training takes seconds. Each replacement must match exactly once, so the test fails
when the README's example changes shape and needs this test's attention."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import openai

from app.core.config import Settings
from tests.conftest import (
    REDIS_URL, _truncate_all, agent_rft_inference, agent_rft_worker, jsonl, live_server, make_project, wait_for,
)
from tests.rl.tool_server import tool_server

README = Path(__file__).resolve().parents[1] / "README.md"
TOKEN = "readme-worker-token"
SEARCH = {"type": "function", "function": {"name": "search", "description": "Full-text search over the reports.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}


def sdk_example() -> tuple[str, str]:
    """The README's first python block, split where it waits for the job to succeed."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    before, marker, after = code.partition("# Once it has succeeded")
    assert marker, "the README's example no longer says where the job has succeeded"
    return before, marker + after


def replace_once(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the README's example no longer has exactly one {old!r}"
    return code.replace(old, new)


def test_the_readme_sdk_example_trains_a_job_and_calls_its_model(pg_url: str, tmp_path: Path):
    settings = Settings(_env_file=None, data_dir=tmp_path / "data", database_url=pg_url, broker_url=REDIS_URL,
                        training_queue=f"test-readme-{uuid.uuid4().hex[:8]}", outbound_allowlist=["127.0.0.1"],
                        checkpoint_dir=tmp_path / "checkpoints", worker_token=TOKEN, lease_seconds=10,
                        inference_models=["tiny-smollm2"], inference_pool_size=1)
    project = make_project(settings)
    rows = [{"messages": [{"role": "user", "content": f"What was ACME's {2000 + i} revenue in $M?"}],
             "tools": [SEARCH], "reference_answer": f"{100 + i}"} for i in range(8)]
    (tmp_path / "train.jsonl").write_bytes(jsonl(rows))
    before, after = sdk_example()
    try:
        with agent_rft_inference(settings, token=TOKEN) as (inference_url, _, _), tool_server() as (tool_url, _):
            settings.inference_url = inference_url
            with live_server(settings) as api_url, \
                    agent_rft_worker(settings, api_url, token=TOKEN, queues=settings.training_queue) as (_, log):
                for old, new in [('"http://127.0.0.1:8000/v1"', repr(f"{api_url}/v1")),
                                 ('"sk-..."', repr(project["key"])),
                                 ('open("train.jsonl", "rb")', f'open({str(tmp_path / "train.jsonl")!r}, "rb")'),
                                 ('"SmolLM2-135M-Instruct"', '"tiny-smollm2"'),
                                 ('"https://tools.example.com/search"', repr(tool_url))]:
                    before = replace_once(before, old, new)
                namespace: dict = {}
                exec(compile(before, "README.md (SDK example, part 1)", "exec"), namespace)  # noqa: S102
                client, job = namespace["client"], namespace["job"]
                wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed"),
                         timeout=280, interval=0.5)
                namespace["job"] = client.fine_tuning.jobs.retrieve(job.id)
                assert namespace["job"].status == "succeeded", (namespace["job"].error, log.read_text()[-3000:])
                exec(compile(after, "README.md (SDK example, part 2)", "exec"), namespace)  # noqa: S102
    finally:
        _truncate_all(pg_url)
    answer = namespace["answer"]
    assert isinstance(answer, openai.types.chat.ChatCompletion) and answer.model == namespace["job"].fine_tuned_model
    assert namespace["message"].role == "assistant"
