"""Request and response shapes of /v1/fine_tuning/jobs, as OpenAI defines them, plus the
agent fields (`tools`, `max_episode_steps`) and one extension object, `x_open_model`."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, field_validator, model_validator

from app.core.response_format import check_response_format
from agent_rft.urls import check_http_url
from app.diagnostics.options import JobDiagnosticOptions
from agent_rft.graders.schemas import Grader

Split = Literal["train", "valid"]

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOL_TIMEOUT_S = 600.0  # OpenAI's documented ceiling for one tool call
MAX_TOOL_CACHE_TTL_S = 30 * 86400.0
MAX_STALENESS = 1  # policy versions the sampling policy may lag the updated one (x_open_model.max_staleness)


def auto_or(kind: type, low: float, high: float, *, low_open: bool = False) -> Any:
    """`"auto"` or a number of `kind` within [low, high] (or (low, high] with low_open)."""
    word = "an integer" if kind is int else "a number"
    lower = f"greater than {low}" if low_open else f"at least {low}"

    def check(value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be 'auto' or {word}")
        if kind is int and not float(value).is_integer():
            raise ValueError(f"must be 'auto' or {word}")
        if (value <= low if low_open else value < low) or value > high:
            raise ValueError(f"must be 'auto' or {word} {lower} and at most {high}, got {value}")
        return kind(value)

    schema = {"anyOf": [{"const": "auto"}, {"type": "integer" if kind is int else "number", "maximum": high,
                        ("exclusiveMinimum" if low_open else "minimum"): low}], "default": "auto"}
    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema)]


class Hyperparameters(BaseModel):
    """OpenAI's three hyperparameters, which every method takes."""

    model_config = ConfigDict(extra="forbid")

    batch_size: auto_or(int, 1, 256) = "auto"
    n_epochs: auto_or(int, 1, 50) = "auto"
    learning_rate_multiplier: auto_or(float, 0, 10, low_open=True) = "auto"


class SupervisedHyperparameters(Hyperparameters):
    """`method.supervised.hyperparameters`: OpenAI's three, no more."""


class DpoHyperparameters(Hyperparameters):
    """`method.dpo.hyperparameters`: OpenAI's three and `beta`, the weight of the penalty for moving
    away from the reference model (OpenAI accepts (0, 2])."""

    beta: auto_or(float, 0, 2, low_open=True) = "auto"


class ReinforcementHyperparameters(Hyperparameters):
    compute_multiplier: auto_or(float, 0, 10, low_open=True) = "auto"
    eval_interval: auto_or(int, 1, 10000) = "auto"
    eval_samples: auto_or(int, 1, 10000) = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class ToolEndpoint(BaseModel):
    """A tool the agent may call: where to POST calls, with which headers. `description` and
    `parameters` (extension) give the schema when the JSONL rows carry none."""

    model_config = ConfigDict(extra="forbid")

    name: str
    server_url: str
    headers: dict[str, str] = Field(default_factory=dict)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    timeout: float | None = Field(
        None, gt=0, le=MAX_TOOL_TIMEOUT_S,
        description="Extension: seconds one attempt of a call may take in all (connect, wait, read), at most 600 "
                    "(OpenAI's ceiling for a tool call, 10 minutes). Default 120; silence while waiting for the "
                    "reply is also cut at 60 s unless this is set.")
    retries: int | None = Field(
        None, ge=0, le=10, description="Extension: retries of a transient failure (408, 429, 5xx, a timeout, a "
                                       "connection error) after the first attempt. Default 3.")
    max_concurrency: int | None = Field(
        None, ge=1, le=1024, description="Extension: the most calls to this tool in flight at once. Default 16.")
    rate_limit: float | None = Field(
        None, gt=0, le=100000, description="Extension: the most calls per second sent to this tool (spread "
                                           "evenly, no burst). Default: unlimited. The variance diagnostic warns "
                                           "when training would exceed it.")
    read_only: bool = Field(
        False, description="Extension: the tool has no side effects (a search, a read). The variance diagnostic "
                           "can skip tools that are not, or send them dry_run (x_open_model.diagnostic."
                           "non_read_only_tools); only a read-only tool may be cached.")
    cache: bool | Annotated[float, Field(gt=0, le=MAX_TOOL_CACHE_TTL_S)] = Field(
        False, description="Extension, read-only tools only: answer an identical call (same tool, same arguments "
                           "as canonical JSON, same item unless cache_per_item is false) from the job's cache "
                           "instead of the endpoint. true: for the whole job; a number: for that many seconds. "
                           "Only successful results are kept. Default off: a stateful tool (per-trace_id state) "
                           "must not be cached.")
    cache_per_item: bool = Field(
        True, description="Extension: the cache key includes the row's item (default). false: identical calls "
                          "from different rows share one entry (the tool's answer does not depend on item).")

    @model_validator(mode="after")
    def _cache_needs_read_only(self) -> ToolEndpoint:
        if self.cache and not self.read_only:
            raise ValueError("cache needs read_only: true (a tool with side effects or per-trace_id state must "
                             "not be answered from a cache)")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not TOOL_NAME.match(name):
            raise ValueError("must be 1-64 letters, digits, '_' or '-'")
        return name

    @field_validator("server_url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_http_url(url)


class ModelOptions(BaseModel):
    """Extension for open-weight models, the options every method takes. Every field has a default."""

    model_config = ConfigDict(extra="forbid")

    training_mode: Literal["lora", "full"] = Field("lora", description="LoRA adapters (peft) or all parameters.")
    lora_rank: int = Field(16, ge=1, le=512)
    lora_alpha: int = Field(32, ge=1, le=1024)
    learning_rate: float | None = Field(
        None, gt=0, le=1, description="Absolute learning rate; overrides learning_rate_multiplier × the base rate.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Weights' precision for sampling and training: auto is bfloat16 on a GPU, float32 on a "
                            "CPU. bfloat16 on a CPU with native support (AVX512-BF16, AMX) is about 1.5x faster; "
                            "LoRA adapters and the optimizer stay in float32.")

    training_processes: int | None = Field(
        None, ge=1, le=64, description="Data-parallel training processes for this job, at most the worker's "
                                       "AGENT_RFT_TRAINING_PROCESSES (a larger number is lowered to it, with a "
                                       "warning event). Default: the worker's setting (docs/scaling.md).")


class OpenModelOptions(ModelOptions):
    """`method.reinforcement.x_open_model`: the shared options plus the rollouts' and the loss's."""

    loss: Literal["grpo", "dr_grpo", "rloo"] = Field("grpo", description="Advantage estimator and normalisation.")
    kl_coef: float = Field(0.0, ge=0, le=10, description="Weight of the KL penalty to the reference policy.")
    clip_epsilon: float = Field(0.2, gt=0, le=1, description="PPO-style ratio clip.")
    max_tokens_per_turn: int = Field(256, ge=1, le=32768)
    max_tokens_per_rollout: int = Field(2048, ge=1, le=262144)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    rollout_timeout: float | None = Field(
        None, gt=0, le=3600, description="Seconds one rollout may take in all, tool calls included. A tool call "
                                         "still running then is cancelled and the rollout ends as a tool failure "
                                         "(excluded from the update); past it between turns, the rollout ends "
                                         "as `deadline` and is graded as it stands. Default: no limit.")
    diagnostic: JobDiagnosticOptions | None = Field(
        None, description="Run the variance diagnostic before training (docs/diagnostics.md).")
    importance_sampling_cap: float | None = Field(
        None, gt=1, le=100, description="Truncated importance sampling: the PPO ratio is taken against the trainer's "
                                        "own log-probs and each sampled token is weighted by min(p_trainer / "
                                        "p_sampler, cap), correcting the sampler's numerical difference (another "
                                        "engine, another precision; see train.logprob_mismatch). 2 is common with "
                                        "vLLM sampling. Default: off (the ratio is against the sampler's log-probs).")
    max_staleness: int = Field(
        0, ge=0, description="How many policy versions the sampling policy may lag the one being updated. 0: "
                             "each step samples, grades, then updates (synchronous). 1: the next step's rollouts "
                             "are sampled and graded while this step updates, so slow tools and the update stop "
                             "waiting for each other; each turn records the version that sampled it, and the "
                             "update corrects for the lag by importance sampling (importance_sampling_cap, 2 "
                             "unless set). Larger values are refused (docs/training.md).")
    refill_zero_spread: bool = Field(
        False, description="Groups without a reward spread teach nothing: sample more prompts until the step "
                           "holds batch_size groups with a spread, drawing at most 4 × batch_size prompts; the "
                           "extra prompts come from the data stream, so an epoch ends sooner.")
    sampler: Literal["auto", "engine", "vllm"] = Field(
        "auto", description="What samples the rollouts: the worker's in-process engine, or the deployment's vLLM "
                            "servers (AGENT_RFT_VLLM_URLS; LoRA only). auto: vLLM where the worker has servers and "
                            "training_mode is lora, else the engine (docs/vllm.md).")

    @field_validator("max_staleness")
    @classmethod
    def _one_step_of_lag_at_most(cls, value: int) -> int:
        if value > MAX_STALENESS:
            raise ValueError("must be 0 or 1: with one step sampled ahead, sampling and the update already run "
                             "side by side, and a longer lag only trains on older samples")
        return value

    @model_validator(mode="after")
    def _vllm_samples_lora_only(self) -> "OpenModelOptions":
        if self.sampler == "vllm" and self.training_mode == "full":
            raise ValueError("sampler 'vllm' samples LoRA policies only: after every step the worker loads the new "
                             "adapter on the servers, and reloading a full model's weights on them each step is not "
                             "supported. Use training_mode 'lora', or sampler 'engine' for full fine-tuning.")
        return self


class TrainingOptions(BaseModel):
    """The part of `method.reinforcement` that says how to train (hyperparameters, the tool-call
    budget, the open-model options): what the worker resolves into its training configuration."""

    model_config = ConfigDict(extra="forbid")

    hyperparameters: ReinforcementHyperparameters = Field(default_factory=ReinforcementHyperparameters)
    max_episode_steps: int = Field(10, ge=1, le=1000, description="Tool-call budget per rollout.")
    x_open_model: OpenModelOptions = Field(default_factory=OpenModelOptions)


class ReinforcementMethod(TrainingOptions):
    grader: Grader
    response_format: dict[str, Any] | None = Field(
        None, description="The final answer's format (`json_schema` or `json_object`): every rollout's answer is "
                          "constrained to it while its tool calls stay free, and graders get `sample.output_json`.")
    tools: list[ToolEndpoint] = Field(default_factory=list, max_length=64)

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_response_format(value)


class SupervisedModelOptions(ModelOptions):
    """`method.supervised.x_open_model`: the shared options plus the sequence length and the
    validation-loss cadence."""

    max_seq_tokens: int = Field(
        4096, ge=16, le=262144, description="Tokens of one row the model trains on: rows longer than this are "
                                            "truncated, and counted, as OpenAI truncates over-long examples.")
    eval_interval: int | None = Field(
        None, ge=1, description="Steps between validation-loss evaluations; default: about 10 evaluations over "
                                "the run.")


class SupervisedMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: SupervisedHyperparameters = Field(default_factory=SupervisedHyperparameters)
    x_open_model: SupervisedModelOptions = Field(default_factory=SupervisedModelOptions)


class DpoMethod(BaseModel):
    """`method.dpo`: preference pairs (docs/dpo.md); the open-model options are a supervised job's."""

    model_config = ConfigDict(extra="forbid")

    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)
    x_open_model: SupervisedModelOptions = Field(default_factory=SupervisedModelOptions)


class Method(BaseModel):
    """`method`: its `type` names a method of the registry (app/jobs/methods/: `reinforcement`,
    `supervised`, `dpo`; another is a 400 naming `method.type`) and the block of that name holds its
    options. A method added to the registry brings its block as an extra field, which its module checks."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(max_length=64, examples=["reinforcement", "supervised", "dpo"])
    reinforcement: ReinforcementMethod | None = None
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None


def method_block(method: dict[str, Any]) -> dict[str, Any]:
    """The block of a stored method that its type names: `method.reinforcement`, `.supervised` or `.dpo`."""
    return method.get(method.get("type") or "") or {}


MAX_INTEGRATIONS = 5  # OpenAI's limits on `integrations`
MAX_WANDB_TAGS = 50
MAX_WANDB_TAG_LENGTH = 64


class WandbOptions(BaseModel):
    """`integrations[].wandb`: where the job's Weights & Biases run goes, as OpenAI takes it."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(min_length=1, max_length=128, description="The W&B project the run is created under.")
    name: str | None = Field(None, max_length=128, description="The run's display name; default: the job id.")
    entity: str | None = Field(None, max_length=128, description="The W&B team or user; default: the key's own.")
    tags: list[Annotated[str, Field(min_length=1, max_length=MAX_WANDB_TAG_LENGTH)]] = Field(
        default_factory=list, max_length=MAX_WANDB_TAGS)


class Integration(BaseModel):
    """One entry of `integrations`; `wandb` is the only type OpenAI defines."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["wandb"]
    wandb: WandbOptions


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    method: Method | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, max_length=64)
    metadata: dict[str, str] | None = None
    hyperparameters: dict[str, Any] | None = Field(
        None, description="Deprecated by OpenAI: a supervised job's hyperparameters (method omitted, or supervised "
                          "without its own); use method.supervised.hyperparameters.")
    integrations: list[Integration] | None = Field(
        None, max_length=MAX_INTEGRATIONS, description="Weights & Biases logging of the run; the W&B API key is "
                                                       "the project's (`agent-rft projects set-wandb-key`).")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(metadata)


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on `metadata` (jobs and diagnostics)."""
    if metadata is None:
        return None
    if len(metadata) > 16:
        raise ValueError("at most 16 key-value pairs")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise ValueError("keys are at most 64 characters and values at most 512")
    return metadata


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(BaseModel):
    batch_size: Any = "auto"
    learning_rate_multiplier: Any = "auto"
    n_epochs: Any = "auto"


class JobObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: JobHyperparameters
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any]
    suffix: str | None = None
    diagnostic_id: str | None = Field(None, description="This service's extension: the variance diagnostic run "
                                      "before training (x_open_model.diagnostic).")


class JobEventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"] = "message"
    data: dict[str, Any] | None = None


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int


MAX_PERMISSION_PROJECTS = 100  # projects one request shares a checkpoint with
ProjectId = Annotated[str, Field(min_length=1, max_length=64)]


class CheckpointPermissionCreate(BaseModel):
    """`POST /v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions`."""

    model_config = ConfigDict(extra="forbid")

    project_ids: list[ProjectId] = Field(min_length=1, max_length=MAX_PERMISSION_PROJECTS,
                                         description="The projects to share the checkpoint with.")


class CheckpointPermissionObject(BaseModel):
    id: str
    object: Literal["checkpoint.permission"] = "checkpoint.permission"
    created_at: int
    project_id: str = Field(description="The project the checkpoint is shared with.")


class CheckpointPermissionDeleted(BaseModel):
    id: str
    object: Literal["checkpoint.permission"] = "checkpoint.permission"
    deleted: bool = True


class RolloutObject(BaseModel):
    """This service's extension: one rollout of a job, as `GET /v1/fine_tuning/jobs/{id}/rollouts` lists it."""

    object: Literal["fine_tuning.job.rollout"] = "fine_tuning.job.rollout"
    id: str = Field(description="The rollout's trace_id.")
    step: int
    split: Split
    sample_index: int
    reward: float | None
    finish_reason: str | None
    tool_calls: int
    data: dict[str, Any]
