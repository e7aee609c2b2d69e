"""A chat-completions request in the rollout engine's terms, and its answer in OpenAI's.

Train/serve parity: the prompt is rendered by the same ChatFormatter (chat template, tool
instructions, tool results, assistant `tool_calls` written in the parser's syntax), generation
stops on the same end-of-turn tokens and parser stop strings, and the answer is read by the same
tool-call parser as in training rollouts. What the agent learned is what it does here.

`tool_choice`: "auto" (the default with tools) parses calls; "none" renders no tools and parses
none; a named function or "required" starts the model's turn with the parser's call syntax
(`<tool_call>{"name": "search", "arguments": {` or `<tool_call>{"name": "`), so the turn is a call;
"required" with a single tool names it, as there is no other to call.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from workers.inference.served import ServedModel
from workers.engine.constraints import AnswerFormat, Constraint, UnsupportedFormat
from workers.engine.sampler import GenerationOutput, GenerationRequest
from workers.engine.toolcalls import ParsedTurn, ToolSchema, as_tool_schemas


class BadChatRequest(Exception):
    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass
class ChatPlan:
    """What to generate for one request: n rows from one prompt."""

    request: dict[str, Any]
    model_name: str
    tools: list[ToolSchema]
    parse_tools: bool
    forced_prefix: str
    prompt_ids: list[int]
    generations: list[GenerationRequest]
    user_stops: list[str]
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")


def plan(request: dict[str, Any], model_name: str, served: ServedModel, *, default_max_tokens: int) -> ChatPlan:
    """Render the prompt and the generation requests; BadChatRequest for what the model cannot do."""
    tools = as_tool_schemas(request.get("tools"))
    choice = request.get("tool_choice") or ("auto" if tools else "none")
    parse_tools = bool(tools) and choice != "none"
    formatter = served.formatter
    try:
        prompt_ids = formatter.prompt_ids(request["messages"], tools if parse_tools else None)
    except ValueError as exc:  # ChatTemplateError is a ValueError; so are bad messages
        raise BadChatRequest(f"The messages cannot be rendered for this model: {exc}", param="messages") from exc
    forced = _forced_prefix(formatter.parser, choice, tools)
    context_ids = prompt_ids + (formatter.encode(forced) if forced else [])
    max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
    _check_context(len(context_ids), max_tokens, served.max_context)
    budget = min(max_tokens or default_max_tokens, served.max_context - len(context_ids))
    user_stops = list(request.get("stop") or [])
    stop_strings = tuple(formatter.parser.stop_strings if parse_tools else ()) + tuple(user_stops)
    seed = request.get("seed")
    base_seed = int(seed) if seed is not None else random.getrandbits(31)
    answer_format = _answer_format(request.get("response_format"), formatter, parse_tools=parse_tools, forced=forced)
    temperature, top_p = request.get("temperature"), request.get("top_p")
    generations = [
        GenerationRequest(context_ids=context_ids, max_new_tokens=budget, seed=_choice_seed(base_seed, index),
                          temperature=1.0 if temperature is None else float(temperature),
                          top_p=1.0 if top_p is None else float(top_p),
                          stop_token_ids=formatter.stop_token_ids(), stop_strings=stop_strings,
                          constraint=_constraint(answer_format, tools=parse_tools))
        for index in range(request.get("n") or 1)
    ]
    return ChatPlan(request=request, model_name=model_name, tools=tools, parse_tools=parse_tools, forced_prefix=forced,
                    prompt_ids=prompt_ids, generations=generations, user_stops=user_stops)


def _answer_format(response_format: dict[str, Any] | None, formatter: Any, *, parse_tools: bool,
                   forced: str) -> AnswerFormat | None:
    """What a JSON `response_format` constrains the answer to: None for text, and for a turn forced to
    be a call; with tools the model may call, a call stays free."""
    if forced:
        return None
    answer_format = AnswerFormat.of(response_format, formatter.tokenizer, formatter.parser)
    if answer_format is not None and parse_tools and answer_format.call_open is None:
        raise BadChatRequest("A JSON response_format with tools is not supported for this model's tool-call format.",
                             code="unsupported_parameter", param="response_format")
    return answer_format


def _constraint(answer_format: AnswerFormat | None, *, tools: bool) -> Constraint | None:
    """One choice's constraint (each keeps its own state)."""
    if answer_format is None:
        return None
    try:
        return answer_format.constraint(tools=tools)
    except UnsupportedFormat as exc:
        raise BadChatRequest(f"Invalid response_format: {exc}.", param="response_format") from exc


def _choice_seed(seed: int, index: int) -> int:
    # Choice 0 samples with the seed itself, as a rollout with that seed does (parity); the others differ.
    return seed if index == 0 else (seed * 1_000_003 + index) % (2**63)


def _forced_prefix(parser: Any, choice: Any, tools: list[ToolSchema]) -> str:
    open_tag = getattr(parser, "OPEN", None)
    if open_tag is None or choice in ("auto", "none"):
        return ""
    if choice == "required" and len(tools) != 1:
        return open_tag + '{"name": "'
    # A named function, or "required" with one tool to call: the call is that tool's.
    name = tools[0].name if choice == "required" else choice["function"]["name"]
    return open_tag + json.dumps({"name": name})[:-1] + ', "arguments": {'


def _check_context(prompt_tokens: int, max_tokens: int | None, window: int) -> None:
    wanted = prompt_tokens + (max_tokens or 1)
    if wanted > window:
        asked = f"{wanted} tokens ({prompt_tokens} in the messages, {max_tokens or 1} in the completion)"
        raise BadChatRequest(f"This model's maximum context length is {window} tokens. However, you requested {asked}. "
                             "Please reduce the length of the messages or the completion.",
                             code="context_length_exceeded", param="messages")


# ---------------------------------------------------------------------------------------------
# Answers


@dataclass
class ChoiceResult:
    index: int
    text: str  # the model's text after stop handling (forced prefix included)
    finish: str  # "stop", "length" or "tool_calls"
    content: str | None
    tool_calls: list[dict[str, Any]]
    completion_tokens: int


def finish_choice(chat: ChatPlan, served: ServedModel, index: int, output: GenerationOutput) -> ChoiceResult:
    """The model's answer for one row: user stop sequences cut, tool calls parsed (same parser as training)."""
    text = chat.forced_prefix + served.formatter.assistant_text(output.token_ids)
    finish = "stop" if output.finish == "stop" else "length"
    for stop in chat.user_stops:
        at = text.find(stop)
        if at >= 0:
            text, finish = text[:at], "stop"
    if chat.parse_tools:
        parsed: ParsedTurn = served.formatter.parser.parse(text, chat.tools, rng=random.Random(chat.generations[index].seed))
        if parsed.calls:
            calls = [call.to_openai() for call in parsed.calls]
            return ChoiceResult(index, text, "tool_calls", parsed.content or None, calls, len(output.token_ids))
    return ChoiceResult(index, text, finish, text, [], len(output.token_ids))


def completion_body(chat: ChatPlan, choices: list[ChoiceResult]) -> dict[str, Any]:
    return {
        "id": chat.id, "object": "chat.completion", "created": chat.created, "model": chat.model_name,
        "system_fingerprint": None,
        "choices": [{
            "index": c.index, "finish_reason": c.finish, "logprobs": None,
            "message": {"role": "assistant", "content": c.content, "refusal": None,
                        **({"tool_calls": c.tool_calls} if c.tool_calls else {})},
        } for c in choices],
        "usage": usage(chat, choices),
    }


def usage(chat: ChatPlan, choices: list[ChoiceResult]) -> dict[str, int]:
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": len(chat.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(chat.prompt_ids) + completion}


# ---------------------------------------------------------------------------------------------
# Streaming


class ChoiceStream:
    """Turns one row's tokens, as they are sampled, into content deltas. Text that may be the start
    of a tool call or of a stop sequence is held back until it is clear; once a tool call begins,
    no more content is streamed (the calls are sent whole at the end, as `tool_calls` deltas)."""

    def __init__(self, chat: ChatPlan, served: ServedModel) -> None:
        self.chat, self.served = chat, served
        self.token_ids: list[int] = []
        self.sent = 0
        self.halted = False
        open_tag = getattr(served.formatter.parser, "OPEN", None) if chat.parse_tools else None
        self.markers = [m for m in [open_tag, *chat.user_stops] if m]
        self.forced = bool(chat.forced_prefix)

    def feed(self, token_id: int) -> str:
        """The new content to send after this token ("" when none)."""
        self.token_ids.append(token_id)
        if self.halted or self.forced:
            return ""
        text = self.served.formatter.assistant_text(self.token_ids)
        if text.endswith("\ufffd"):  # a multi-byte character not complete yet
            return ""
        cut = min((at for m in self.markers if (at := text.find(m)) >= 0), default=None)
        if cut is not None:
            self.halted = True
            return self._take(text, cut)
        return self._take(text, len(text) - _held_back(text, self.markers))

    def _take(self, text: str, until: int) -> str:
        delta = text[self.sent:until] if until > self.sent else ""
        self.sent = max(self.sent, until)
        return delta

    def rest(self, result: ChoiceResult) -> str:
        """Content not streamed yet once the row is finished (the held-back tail)."""
        if result.tool_calls:
            return ""
        return result.text[self.sent:] if len(result.text) > self.sent else ""


def _held_back(text: str, markers: list[str]) -> int:
    """How many trailing characters could be the beginning of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                longest = max(longest, size)
                break
    return longest


def chunk(chat: ChatPlan, choices: list[dict[str, Any]], *, usage_block: dict[str, int] | None = None) -> str:
    body: dict[str, Any] = {"id": chat.id, "object": "chat.completion.chunk", "created": chat.created,
                            "model": chat.model_name, "system_fingerprint": None, "choices": choices}
    if usage_block is not None:
        body["usage"] = usage_block
    return f"data: {json.dumps(body)}\n\n"


def delta(index: int, *, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": fields, "logprobs": None, "finish_reason": finish}


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"index": k, **call} for k, call in enumerate(calls)]
