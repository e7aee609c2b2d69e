"""Responses items to chat messages and back: a response is a chat completion of the same
conversation, so serving, the prompt format and the tool-call parser are the ones chat completions
(and rollouts) use, and greedy answers are the same."""

from __future__ import annotations

import json
import time
from typing import Any

from app.core.errors import bad_request
from agent_rft.ids import new_id
from app.responses.schemas import ResponseCreate

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def input_items(body: ResponseCreate) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages for a conversation of input items: consecutive function calls become one
    assistant turn's `tool_calls`; reasoning items are dropped (no model here reasons)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and ("tool_calls" in last or not last.get("content")):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":
            raise bad_request(f"Input items of type '{kind}' are not supported (message, function_call, "
                              "function_call_output).", param=f"input[{i}].type", code="unsupported_parameter")
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = ROLES.get(item.get("role", ""))
    if role is None:
        raise bad_request(f"input[{i}].role must be one of {', '.join(ROLES)}.", param=f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, list):
        parts = [part for part in content if isinstance(part, dict)]
        unsupported = next((p.get("type") for p in parts if p.get("type") not in TEXT_PARTS), None)
        if unsupported is not None or len(parts) != len(content):
            raise bad_request(f"Content parts of type '{unsupported}' are not supported (input_text, output_text).",
                              param=f"input[{i}].content", code="unsupported_parameter")
        content = "".join(str(part.get("text", "")) for part in parts)
    if not isinstance(content, str):
        raise bad_request(f"input[{i}].content must be a string or a list of text parts.", param=f"input[{i}].content")
    return {"role": role, "content": content}


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "arguments":
        raise bad_request(f"input[{i}].{key} must be a string.", param=f"input[{i}].{key}")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "parameters", ...}`) in chat's shape."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"Only function tools are supported, not '{tool.get('type')}'.", param=f"tools[{i}].type",
                              code="unsupported_parameter")
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def chat_request(body: ResponseCreate, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request for a Responses request over the conversation `items`."""
    choice = body.tool_choice
    request: dict[str, Any] = {
        "model": body.model, "messages": chat_messages(items, body.instructions), "tools": chat_tools(body.tools),
        "tool_choice": ({"type": "function", "function": {"name": choice.name}} if not isinstance(choice, (str, type(None)))
                        else choice),
        "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
        "response_format": chat_response_format((body.text or {}).get("format")),
    }
    return {key: value for key, value in request.items() if value is not None}


def chat_response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Responses `text.format` as chat's `response_format` (a schema's fields sit one level up)."""
    if not text_format or text_format.get("type") == "text":
        return None
    if text_format.get("type") == "json_schema":
        spec = {key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}
        return {"type": "json_schema", "json_schema": spec}
    if text_format.get("type") == "json_object":
        return {"type": "json_object"}
    raise bad_request(f"text.format type '{text_format.get('type')}' is not one of text, json_object, json_schema.",
                      param="text.format")


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion choice as Responses output items: the text, then each function call."""
    message = choice.get("message") or {}
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def message_item(text: str, *, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str, *, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc_"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_object(body: ResponseCreate, *, response_id: str, output: list[dict[str, Any]], finish_reason: str | None,
                    usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
    """OpenAI's response object."""
    cut = finish_reason == "length"
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": status or ("incomplete" if cut else "completed"), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut and status is None else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": body.store is not False, "temperature": body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": (body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
                        else body.tool_choice or "auto"),
        "tools": body.tools or [], "top_p": body.top_p, "truncation": "disabled", "metadata": body.metadata or {},
        "usage": None if status == "in_progress" else {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion},
        "user": None,
    }
