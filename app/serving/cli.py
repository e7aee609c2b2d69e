"""`agent-rft chat MODEL`: a quick try of a base model, fine-tuned model or checkpoint through the
server's `/v1/chat/completions`, with the official `openai` SDK (streamed, tool calls shown)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from app.cli_client import CliError, api_errors

Echo = Callable[..., None]


def read_tools(path: Path) -> list[dict[str, Any]]:
    """Tool schemas: a JSON list in OpenAI's format (`{"type": "function", "function": {...}}`), or the
    flat `{name, description, parameters}` entries that `agent-rft rollout --tools` reads."""
    try:
        tools = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"{path}: cannot read tools: {exc}") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise CliError(f"{path}: expected a JSON list of tools")
    return [t if "function" in t else {"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description", ""),
        "parameters": t.get("parameters") or {"type": "object", "properties": {}}}} for t in tools]


def chat_turn(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]],
              max_tokens: int, temperature: float, echo: Echo, tool_choice: str | None = None) -> dict[str, Any]:
    """Stream one answer to the terminal; return it as an assistant message (tool calls included)."""
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    if tool_choice:  # sent even without tools: the server then names what is wrong with it
        kwargs["tool_choice"] = as_tool_choice(tool_choice)
    content, calls, finish = [], {}, None
    with api_errors():
        stream = client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=max_tokens,
                                                temperature=temperature, **kwargs)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    content.append(choice.delta.content)
                    echo(choice.delta.content, nl=False)
                for call in choice.delta.tool_calls or []:
                    calls.setdefault(call.index, call.model_dump(exclude_none=True, exclude={"index"}))
                finish = choice.finish_reason or finish
    echo("")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
        for call in message["tool_calls"]:
            echo(f"→ tool call {call['function']['name']}({call['function']['arguments']})  [{call['id']}]")
    echo(f"[finish_reason: {finish}]")
    return message


def as_tool_choice(value: str) -> str | dict[str, Any]:
    """`auto`, `none` and `required` as they are; any other value names the function to call."""
    if value in ("auto", "none", "required"):
        return value
    return {"type": "function", "function": {"name": value}}


def chat(client: openai.OpenAI, model: str, *, tools: list[dict[str, Any]], system: str | None, message: str | None,
         max_tokens: int, temperature: float, echo: Echo, ask: Callable[[str], str],
         tool_choice: str | None = None) -> None:
    """One question (`message`), or a conversation read with `ask` until an empty line or end of input.
    When the model calls a tool, `ask` takes the tool's result (empty: none), as an agent loop would.
    `tool_choice` applies to the model's first answer to each message; once tool results are back,
    the model chooses (a forced call on every turn would never let it answer)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    while True:
        text = message if message is not None else _read(ask, "you> ")
        if not text:
            return
        messages.append({"role": "user", "content": text})
        choice = tool_choice
        while True:
            answer = chat_turn(client, model, messages, tools=tools, max_tokens=max_tokens, temperature=temperature,
                               echo=echo, tool_choice=choice)
            choice = None
            messages.append(answer)
            results = [(call, _read(ask, f"result of {call['function']['name']}> ") if message is None else "")
                       for call in answer.get("tool_calls", [])]
            if not results or not all(output for _, output in results):
                break
            messages += [{"role": "tool", "tool_call_id": call["id"], "content": output} for call, output in results]
        if message is not None:
            return


def _read(ask: Callable[[str], str], prompt: str) -> str:
    try:
        return ask(prompt).strip()
    except EOFError:
        return ""
