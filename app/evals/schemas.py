"""Request and response shapes of `/v1/evals` in the `openai` SDK's own terms (`client.evals`,
`client.evals.runs`, `client.evals.runs.output_items`), plus this service's extension: a run's
`data_source.x_open_model` (tool endpoints, the tool-call budget, samples per item)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.jobs.schemas import ToolEndpoint, check_metadata

MAX_CRITERIA = 20
MAX_CONTENT_ROWS = 10_000
MAX_SAMPLES_PER_ITEM = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    return check_metadata(metadata)


# --- evals ------------------------------------------------------------------------------------------


class CustomDataSourceConfig(_Strict):
    type: Literal["custom"]
    item_schema: dict[str, Any]
    include_sample_schema: bool = False


class EvalCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    # Only `custom` runs here: `logs` and `stored_completions` read OpenAI's own logs (service.py says so).
    data_source_config: dict[str, Any]
    testing_criteria: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_CRITERIA)
    metadata: dict[str, str] | None = None

    _check_metadata = field_validator("metadata")(_metadata)


class EvalUpdate(_Strict):
    name: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None

    _check_metadata = field_validator("metadata")(_metadata)


class EvalObject(BaseModel):
    id: str
    object: Literal["eval"] = "eval"
    created_at: int
    name: str
    data_source_config: dict[str, Any] = Field(description="`custom`: its JSON schema of `item` (and `sample`).")
    testing_criteria: list[dict[str, Any]] = Field(description="The graders, header values masked.")
    metadata: dict[str, str] | None = None


class EvalDeleted(BaseModel):
    object: Literal["eval.deleted"] = "eval.deleted"
    deleted: bool = True
    eval_id: str


# --- runs ---------------------------------------------------------------------------------------------


class ContentRow(_Strict):
    item: dict[str, Any]
    sample: dict[str, Any] | None = None


class FileContentSource(_Strict):
    type: Literal["file_content"]
    content: list[ContentRow] = Field(min_length=1, max_length=MAX_CONTENT_ROWS)


class FileIdSource(_Strict):
    type: Literal["file_id"]
    id: str = Field(min_length=1, max_length=64)


Source = Annotated[FileContentSource | FileIdSource, Field(discriminator="type")]


class TemplateMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] | None = None


class TemplateInput(_Strict):
    type: Literal["template"]
    template: list[TemplateMessage] = Field(min_length=1, max_length=256)


class ItemReferenceInput(_Strict):
    type: Literal["item_reference"]
    item_reference: str = Field(min_length=1, max_length=256, description="e.g. `item.messages`")


InputMessages = Annotated[TemplateInput | ItemReferenceInput, Field(discriminator="type")]


class SamplingParams(BaseModel):
    """Both data sources' sampling parameters: `response_format` (completions) or `text.format`
    (responses); `tools` in either shape (`{"type": "function", "function": {...}}` or flat)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    response_format: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class AgentOptions(_Strict):
    """`data_source.x_open_model`: every item becomes a rollout against the customer's tools, as
    in training (the same engine and records), and `samples_per_item` samples of each."""

    tools: list[ToolEndpoint] = Field(default_factory=list, max_length=64)
    max_episode_steps: int = Field(10, ge=0, le=1000, description="Tool calls per item.")
    samples_per_item: int = Field(1, ge=1, le=MAX_SAMPLES_PER_ITEM)
    max_tokens_per_rollout: int | None = Field(None, ge=1, le=262144,
                                               description="Sampled tokens per item, all turns together.")
    rollout_timeout: float | None = Field(None, gt=0, le=3600, description="Seconds one item may take.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class ModelDataSource(_Strict):
    type: Literal["completions", "responses"]
    source: Source
    model: str = Field(min_length=1, max_length=256)
    input_messages: InputMessages | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    x_open_model: AgentOptions = Field(default_factory=AgentOptions)


class JsonlDataSource(_Strict):
    type: Literal["jsonl"]
    source: Source


DataSource = Annotated[ModelDataSource | JsonlDataSource, Field(discriminator="type")]


class RunCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    data_source: dict[str, Any]
    metadata: dict[str, str] | None = None

    _check_metadata = field_validator("metadata")(_metadata)


class ResultCounts(BaseModel):
    total: int = 0
    passed: int = 0
    failed: int = 0
    errored: int = 0


class CriterionResult(BaseModel):
    testing_criteria: str
    passed: int
    failed: int


class ModelUsage(BaseModel):
    model_name: str
    invocation_count: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


class RunError(BaseModel):
    code: str
    message: str


class RunObject(BaseModel):
    id: str
    object: Literal["eval.run"] = "eval.run"
    eval_id: str
    created_at: int
    name: str
    model: str
    status: str
    data_source: dict[str, Any] = Field(description="As created; tool header values masked.")
    error: RunError | None = None
    metadata: dict[str, str] | None = None
    result_counts: ResultCounts
    per_testing_criteria_results: list[CriterionResult]
    per_model_usage: list[ModelUsage]
    report_url: str
    x_items_total: int | None = Field(None, description="Extension: items x samples this run grades.")


class RunDeleted(BaseModel):
    object: Literal["eval.run.deleted"] = "eval.run.deleted"
    deleted: bool = True
    run_id: str


class OutputItemObject(BaseModel):
    id: str
    object: Literal["eval.run.output_item"] = "eval.run.output_item"
    eval_id: str
    run_id: str
    created_at: int
    status: str
    datasource_item_id: int
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]]
    sample: dict[str, Any]
    x_sample_index: int = Field(0, description="Extension: which of the item's samples this is.")
    x_trace_id: str = Field(description="Extension: the trace id sent to every tool and grader call of this item.")
    x_trajectory: dict[str, Any] | None = Field(
        None, description="Extension: the rollout as training records it (messages, tool calls, tokens, seconds).")
