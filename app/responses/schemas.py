"""The Responses API request as the `openai` SDK sends it. Every field is honoured, accepted with
the value that means "off", or refused with 400 naming it (`unsupported_parameter`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Fields accepted only with the values that change nothing here.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "background": (None, False),
    "top_logprobs": (None, 0),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "user": (None,),
    "max_tool_calls": (None,),
}
# `include` values accepted: a model without reasoning has no reasoning to include.
ACCEPTED_INCLUDES = frozenset({"reasoning.encrypted_content"})


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1)


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(None, max_length=64)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # accepted: these models do not reason, no reasoning item
    include: list[str] | None = None
    truncation: Any = None
    service_tier: Any = None
    background: Any = None
    top_logprobs: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    user: Any = None
    max_tool_calls: Any = None

    def unsupported_field(self) -> str | None:
        for name, allowed in NO_OP_VALUES.items():
            if getattr(self, name) not in allowed:
                return name
        if any(value not in ACCEPTED_INCLUDES for value in self.include or []):
            return "include"
        return None
