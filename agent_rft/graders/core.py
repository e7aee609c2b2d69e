"""What every grader shares: the sample being graded, the result, the error flags OpenAI
defines, the deployment context, and the dispatch from a config to its implementation.

Pure Python: importable by the API (for /alpha/graders/run) and by the workers (training)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from agent_rft.graders.isolation import PythonIsolation

# OpenAI's `metadata.errors` flags, all reported on every result.
ERROR_FLAGS = (
    "formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
    "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
    "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error",
)
# Flags whose details travel in a companion field.
DETAIL_FIELDS = {
    "model_grader_server_error": "model_grader_server_error_details",
    "python_grader_runtime_error": "python_grader_runtime_error_details",
    "python_grader_server_error": "python_grader_server_error_type",
}


class GraderError(Exception):
    """A grading failure with OpenAI's flag for it: the sample scores 0 and the flag is set."""

    def __init__(self, flag: str, message: str) -> None:
        assert flag in ERROR_FLAGS, flag
        super().__init__(message)
        self.flag = flag
        self.message = message


@dataclass
class Sample:
    """The model's output as graders and templates see it (`{{sample.*}}`)."""

    output_text: str = ""
    output_json: Any = None
    output_tools: list[dict[str, Any]] = field(default_factory=list)
    choices: list[dict[str, Any]] = field(default_factory=list)
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_model_sample(cls, model_sample: str | dict[str, Any]) -> "Sample":
        if isinstance(model_sample, str):
            return cls(output_text=model_sample, output_json=_json_object(model_sample))
        text = model_sample.get("output_text") or ""
        output_json = model_sample.get("output_json")
        return cls(
            output_text=text,
            output_json=output_json if output_json is not None else _json_object(text),
            output_tools=list(model_sample.get("output_tools") or []),
            choices=list(model_sample.get("choices") or []),
            trajectory=list(model_sample.get("trajectory") or []),
            usage=dict(model_sample.get("usage") or {}),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "output_text": self.output_text, "output_json": self.output_json, "output_tools": self.output_tools,
            "choices": self.choices, "trajectory": self.trajectory, "usage": self.usage,
        }


def _json_object(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, (dict, list)) else None


@dataclass
class GradeResult:
    name: str
    type: str
    reward: float
    errors: dict[str, Any] = field(default_factory=lambda: {flag: False for flag in ERROR_FLAGS})
    execution_time: float = 0.0
    scores: dict[str, Any] = field(default_factory=dict)
    sub_rewards: dict[str, Any] = field(default_factory=dict)
    token_usage: int | None = None
    # {model: {"prompt_tokens": n, "completion_tokens": n, "total_tokens": n}} for model judges.
    model_token_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    sampled_model_name: str | None = None
    passed: bool | None = None

    @property
    def failed(self) -> bool:
        return any(self.errors.get(flag) for flag in ERROR_FLAGS)

    def flag(self, error: GraderError) -> "GradeResult":
        self.errors[error.flag] = True
        if error.flag in DETAIL_FIELDS:
            self.errors[DETAIL_FIELDS[error.flag]] = error.message
        self.errors.setdefault("details", error.message)
        self.reward = 0.0
        return self

    def to_run_response(self) -> dict[str, Any]:
        """The body of POST /v1/fine_tuning/alpha/graders/run."""
        errors = {flag: bool(self.errors.get(flag)) for flag in ERROR_FLAGS}
        errors.update({f: self.errors.get(f) for f in DETAIL_FIELDS.values()})
        return {
            "reward": self.reward,
            "metadata": {
                "name": self.name, "type": self.type, "errors": errors, "execution_time": self.execution_time,
                "scores": self.scores, "token_usage": self.token_usage, "sampled_model_name": self.sampled_model_name,
            },
            "sub_rewards": self.sub_rewards,
            "model_grader_token_usage_per_model": self.model_token_usage,
        }


@dataclass
class GraderContext:
    """Deployment-level services graders use. One per process (or per job)."""

    outbound_allowlist: list[str] = field(default_factory=list)
    # Model judges (score_model / label_model): an OpenAI-compatible chat-completions endpoint...
    judge_base_url: str | None = None
    judge_api_key: str | None = None
    # ...or a local transformers model (a name from the model registry, or a directory).
    judge_local_model: str | None = None
    request_timeout_s: float = 30.0
    # Backpressure of endpoint graders and remote judges (agent_rft/graders/judges.py): the longest wait a
    # Retry-After gets, the most such waits one request may add up, in-flight requests per URL (AIMD).
    max_retry_after_s: float = 60.0
    max_throttle_wait_s: float = 600.0
    max_concurrency_per_url: int = 64
    python_timeout_s: float = 10.0
    python_memory_mb: int = 512
    # The least sandbox isolation python graders run under, and (tests) a cap on what the probe may pick.
    python_min_isolation: PythonIsolation = PythonIsolation.AUDIT_HOOK
    python_isolation_cap: PythonIsolation | None = None
    http_client: httpx.AsyncClient | None = None
    # Shared state of grader implementations (rate limiters, loaded judges), keyed by their owner.
    shared: dict[str, Any] = field(default_factory=dict)
    # Loads the local judge by name into (model, tokenizer): the workers' model loader, given by the
    # process that runs graders (the library itself loads no model).
    load_judge_model: Callable[[str], Any] | None = None

    @classmethod
    def from_settings(cls, settings: Any, *, load_judge_model: Callable[[str], Any] | None = None) -> GraderContext:
        """The deployment's grader services, from its settings (app/core/config.py's `Settings`)."""
        return cls(
            load_judge_model=load_judge_model,
            outbound_allowlist=list(settings.outbound_allowlist),
            judge_base_url=settings.judge_base_url,
            judge_api_key=settings.judge_api_key.get_secret_value() if settings.judge_api_key else None,
            judge_local_model=settings.judge_local_model,
            request_timeout_s=settings.grader_timeout_s,
            max_retry_after_s=settings.grader_max_retry_after_s,
            max_concurrency_per_url=settings.grader_max_concurrency,
            python_timeout_s=settings.python_grader_timeout_s,
            python_memory_mb=settings.python_grader_memory_mb,
            python_min_isolation=settings.python_grader_required_isolation,
            python_isolation_cap=settings.python_grader_isolation_cap,
        )


GradeFn = Callable[[Any, Sample, dict[str, Any], GraderContext, str | None], Awaitable[GradeResult]]
_IMPLEMENTATIONS: dict[str, GradeFn] = {}


def implements(grader_type: str) -> Callable[[GradeFn], GradeFn]:
    def register(fn: GradeFn) -> GradeFn:
        _IMPLEMENTATIONS[grader_type] = fn
        return fn

    return register


async def grade(
    config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None = None
) -> GradeResult:
    """Grade one sample. Never raises for a grading failure: the result carries the flag."""
    from agent_rft.graders import implementations  # noqa: F401 - registers every type

    started = time.perf_counter()
    try:
        result = await _IMPLEMENTATIONS[config.type](config, sample, item, ctx, trace_id)
    except GraderError as error:
        result = GradeResult(name=config.name, type=config.type, reward=0.0).flag(error)
    except Exception as error:  # noqa: BLE001 - a grader bug must score 0 and say why, not kill a job
        result = GradeResult(name=config.name, type=config.type, reward=0.0).flag(
            GraderError("other_error", f"{type(error).__name__}: {error}")
        )
    result.execution_time = time.perf_counter() - started
    return result
