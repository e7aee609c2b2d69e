"""`/v1/chat/completions` and `/v1/models` in OpenAI's shapes, as the official SDK sends and parses them.

Every field of OpenAI's chat-completions request is either honoured or refused with 400 naming it
(`unsupported_parameter`): never silently ignored. A field sent with its no-op value
(`logprobs: false`, `presence_penalty: 0`, `response_format: {"type": "text"}`, ...) is accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.core.response_format import check_response_format
from app.jobs.validation import RowProblem, check_messages, check_tools

MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 4

# OpenAI fields this service does not implement, each with the values that mean "off".
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # the SDK may send it; there is nothing to obfuscate


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a turn may hold several calls; SmolLM2's parser stops at the first
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # Accepted only with their no-op values (NO_OP_VALUES): anything else is refused by name.
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    store: Any = None
    metadata: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        try:
            check_messages(messages, last_must_be_user=False)
        except RowProblem as problem:
            raise ValueError(problem.message) from None
        return messages

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools is not None:
            try:
                check_tools(tools, None)
            except RowProblem as problem:
                raise ValueError(problem.message) from None
        return tools

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > MAX_STOP_SEQUENCES or not all(stops)):
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} non-empty stop sequences")
        return stops

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_response_format(value)

    def unsupported_field(self) -> str | None:
        """The first field set to something this service does not implement."""
        for name, allowed in NO_OP_VALUES.items():
            if getattr(self, name) not in allowed:
                return name
        return None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool
