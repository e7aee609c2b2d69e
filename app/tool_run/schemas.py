"""The body OpenAI's Agent RFT harness sends to `tool/run`, and the answer it reads (`output`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent_rft.urls import check_http_url

# Headers that describe the request itself, which the tool call sets: forwarding a caller's would
# corrupt it.
REQUEST_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class ToolRunRequest(BaseModel):
    # The harness may add fields of its own (its `payload_extra`); they are accepted and not forwarded.
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"] = "function_call"
    name: str = Field(min_length=1, max_length=64, description="The tool's name, as the model called it.")
    server_url: str = Field(min_length=1, max_length=2048, description="Where the call is POSTed.")
    headers: dict[str, str] = Field(default_factory=dict, description="Sent with the call (e.g. Authorization).")
    arguments: str | dict[str, Any] = Field("{}", description="The call's arguments: a JSON string, as the model wrote them.")
    item: dict[str, Any] | None = Field(None, description="The dataset row, forwarded as the tool's `item`.")
    trace_id: str | None = Field(None, max_length=128, description="The trace the call belongs to; new when absent.")
    id: str | None = Field(None, max_length=128, description="The function call item's id; new when absent.")
    call_id: str | None = Field(None, max_length=128, description="The call's id; new when absent.")
    # As a job's tool: its `timeout` (seconds per attempt) and `retries`.
    timeout: float | None = Field(None, gt=0, le=600)
    retries: int | None = Field(None, ge=0, le=10)

    @field_validator("server_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_http_url(url)

    @field_validator("headers")
    @classmethod
    def _no_request_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        refused = sorted(name for name in headers if name.lower() in REQUEST_HEADERS)
        if refused:
            raise ValueError(f"'{refused[0]}' describes the request itself and cannot be forwarded")
        return headers
