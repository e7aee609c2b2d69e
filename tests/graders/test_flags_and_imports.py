"""The error flags not covered by one grader type's own tests, and the import boundary:
graders load in the API without torch and in workers without web code."""

import asyncio
import subprocess
import sys

import pytest
from pydantic import TypeAdapter

from agent_rft.graders import sandbox
from agent_rft.graders.core import GraderContext, Sample, grade
from agent_rft.graders.schemas import Grader

GRADER = TypeAdapter(Grader)


def run(config: dict, sample, item=None, ctx=None):  # noqa: ANN001, ANN201
    return asyncio.run(grade(GRADER.validate_python(config), Sample.from_model_sample(sample), item or {},
                             ctx or GraderContext()))


def test_output_json_of_a_non_json_sample_is_a_sample_parse_error():
    config = {"type": "string_check", "name": "j", "input": "{{sample.output_json.answer}}", "reference": "42",
              "operation": "eq"}
    assert run(config, '{"answer": "42"}').reward == 1.0
    result = run(config, "The answer is 42, not JSON")
    assert result.reward == 0.0 and result.errors["sample_parse_error"]
    assert "output_json" in result.errors["details"] and not result.errors["invalid_variable_error"]
    missing_key = run(config, '{"other": 1}')
    assert missing_key.errors["invalid_variable_error"] and not missing_key.errors["sample_parse_error"]


def test_a_judge_prompt_too_long_to_show_is_a_truncated_observation_error():
    config = {"type": "score_model", "name": "judge", "model": "any",
              "input": [{"role": "user", "content": "Grade this: {{sample.output_text}}"}]}
    # No judge is configured: the size check must fire before any call is attempted.
    result = run(config, "x" * 500_000)
    assert result.reward == 0.0 and result.errors["truncated_observation_error"]
    assert "500" in result.errors["details"] and not result.errors["model_grader_server_error"]


def test_a_sandbox_that_cannot_start_is_a_python_grader_server_error(monkeypatch):
    monkeypatch.setattr(sandbox, "_interpreter_argv", lambda: ["/nonexistent/python3"])
    result = run({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}, "x")
    assert result.reward == 0.0 and result.errors["python_grader_server_error"]
    assert "nonexistent" in result.errors["python_grader_server_error_type"]
    assert not result.errors["python_grader_runtime_error"]


@pytest.mark.parametrize("modules", [
    "agent_rft.graders.core, agent_rft.graders.implementations, agent_rft.graders.batch, agent_rft.graders.schemas",
    "workers.celery_app, workers.engine.toolcalls, workers.engine.tools_client, agent_rft.graders.batch",
])
def test_importing_graders_pulls_in_no_web_framework_and_no_torch(modules):
    code = (f"import {modules}\nimport sys\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'torch', "
            "'transformers', 'sentence_transformers', 'nltk'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
