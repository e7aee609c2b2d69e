"""Tool schemas, tool calls, and the parsers that find tool calls in a model's text.

One parser per model family, chosen by `parser_for(model_name)`, and the SAME parser is used by
training rollouts, evaluation and the variance diagnostic, so a call that counts in one counts
in all (one parser for training, eval and serving). A parser never raises on model output: every problem becomes a
`ParseIssue` that is counted and shown to the model (`ParsedTurn.error_feedback()`), because
small models get the syntax wrong often and a rollout must go on, not crash.

Families: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(`HermesParser`) serve SmolLM2, Qwen, Hermes and every unknown model. Register another with
`register_parser(family, factory)`.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import jsonschema
from jsonschema.exceptions import best_match

IssueKind = Literal["malformed_json", "unknown_tool", "invalid_arguments", "missing_name", "unclosed_tool_call"]
ISSUE_KINDS: frozenset[str] = frozenset(IssueKind.__args__)  # type: ignore[attr-defined]

# A ParseIssue keeps this much of the offending text: enough to debug, never a megabyte.
RAW_EXCERPT_CHARS = 500
# Feedback to the model lists this many problems; the rest are summarised in one line.
FEEDBACK_MAX_ISSUES = 5
# Schemas quoted in feedback are cut to this length so one huge schema cannot flood the context.
FEEDBACK_SCHEMA_CHARS = 600


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class ToolSchema:
    """A tool the model may call: name, description and JSON-schema `parameters`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, spec: dict[str, Any]) -> ToolSchema:
        """From OpenAI's Chat Completions format `{"type": "function", "function": {name,
        description, parameters}}`, or the flat Responses-API format `{"type": "function", name,
        description, parameters}`. Raises ValueError on anything else."""
        if not isinstance(spec, dict):
            raise ValueError(f"a tool must be a JSON object, got {type(spec).__name__}")
        if spec.get("type", "function") != "function":
            raise ValueError(f"only tools of type 'function' are supported, got type {spec.get('type')!r}")
        function = spec.get("function", spec)
        if not isinstance(function, dict):
            raise ValueError("a tool's 'function' must be a JSON object")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a tool needs a non-empty string 'name'")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise ValueError(f"the 'parameters' of tool {name!r} must be a JSON schema object")
        description = function.get("description") or ""
        return cls(name=name, description=str(description), parameters=parameters)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's Chat Completions format, which Hugging Face chat templates also expect."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def as_tool_schemas(tools: list[ToolSchema | dict[str, Any]] | None) -> list[ToolSchema]:
    """Accept ToolSchema objects or OpenAI-format dicts (what JSONL rows carry)."""
    return [t if isinstance(t, ToolSchema) else ToolSchema.from_openai(t) for t in tools or []]


@dataclass
class ToolCall:
    """One well-formed call to a known tool with schema-valid arguments: safe to send."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str  # what goes into the tool request's "arguments" (docs/tool-server.md)

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry (for trajectories and `output_tools`)."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class ParseIssue:
    """A tool call the model attempted that cannot be run as written.

    `message` is a complete sentence meant for the model (it names the call and says how to fix
    it); `index` is the 1-based number of the `<tool_call>` block in the turn (0: not tied to one).
    """

    kind: IssueKind
    message: str
    raw: str
    index: int = 0


@dataclass
class ParsedTurn:
    """What one assistant turn said: its text outside tool calls, the runnable calls, the problems."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    issues: list[ParseIssue] = field(default_factory=list)

    @property
    def parse_errors(self) -> int:
        return len(self.issues)

    def error_feedback(self) -> str:
        """A message for the model's next turn that lists each problem and how to fix it; ""
        when there is none."""
        if not self.issues:
            return ""
        lines = [f"- {issue.message}" for issue in self.issues[:FEEDBACK_MAX_ISSUES]]
        hidden = len(self.issues) - FEEDBACK_MAX_ISSUES
        if hidden > 0:
            lines.append(f"- ... and {hidden} more problem(s) of the same kinds.")
        return "There were problems with the tool calls in your last message:\n" + "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The parser interface and its registry


@runtime_checkable
class ToolCallParser(Protocol):
    """Finds tool calls in a model's text, for one family of models."""

    # Strings that end a model turn for this family besides the tokenizer's end-of-turn token.
    stop_strings: list[str]

    def parse(self, text: str, tools: list[ToolSchema], *, rng: random.Random | None = None) -> ParsedTurn:
        """Never raises: problems are ParseIssues."""
        ...

    def format_instructions(self, tools: list[ToolSchema]) -> str:
        """System-prompt text describing the tools and the call syntax, for chat templates that
        cannot render tools themselves. "" when there are no tools."""
        ...

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        """OpenAI `tool_calls` entries written in this family's call syntax (for assistant messages
        from a dataset's history, which carry structured calls rather than the model's text)."""
        ...

    def format_tool_results(self, outputs: list[str]) -> str:
        """Tool outputs as the text of one user message, for templates without a `tool` role."""
        ...


ParserFactory = Callable[[], ToolCallParser]
_REGISTRY: dict[str, ParserFactory] = {}


def register_parser(family: str, factory: ParserFactory) -> None:
    """Use `factory()` for every model whose name contains `family` (case-insensitive; the
    longest matching family wins, so "qwen3" can override "qwen")."""
    if not family or not family.strip():
        raise ValueError("a parser family needs a non-empty name")
    _REGISTRY[family.strip().lower()] = factory


def parser_for(model_name: str | None, tokenizer: Any = None) -> ToolCallParser:
    """The parser for a model, by the family its name (or its tokenizer's name) contains;
    Hermes-style when none matches, which is what most open models and our prompt use."""
    names = [n.lower() for n in (model_name, getattr(tokenizer, "name_or_path", None)) if isinstance(n, str)]
    matches = [family for family in _REGISTRY if any(family in name for name in names)]
    if not matches:
        return HermesParser()
    return _REGISTRY[max(matches, key=len)]()


# ---------------------------------------------------------------------------------------------
# Hermes-style calls


class HermesParser:
    """`<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>`, any number per turn.

    Tolerated: whitespace and newlines around the JSON, a ```json fence inside the block,
    `arguments` given as a JSON string (decoded), `parameters` instead of `arguments`, and an
    unclosed block (reported, still run when its JSON is complete).

    `stop_at_first_call` (default True) makes `</tool_call>` a stop string: generation ends right
    after the first call, so a small model cannot hallucinate the tool's response or waste tokens
    past it; it calls again in its next turn. With False a turn ends only at the end-of-turn token
    and may hold several calls.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    SYNTAX = '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>'

    def __init__(self, *, stop_at_first_call: bool = True) -> None:
        self.stop_at_first_call = stop_at_first_call
        self.stop_strings: list[str] = [self.CLOSE] if stop_at_first_call else []

    # -- parsing ----------------------------------------------------------------------------------

    def parse(self, text: str, tools: list[ToolSchema], *, rng: random.Random | None = None) -> ParsedTurn:
        if not isinstance(text, str):
            text = "" if text is None else str(text)
        by_name = {tool.name: tool for tool in tools}
        validators: dict[str, Any] = {}
        content_parts, blocks = _split_blocks(text, self.OPEN, self.CLOSE)
        turn = ParsedTurn(content="".join(content_parts).strip())
        for index, (body, closed) in enumerate(blocks, start=1):
            try:
                call, issue = self._parse_block(body, closed, index, by_name, validators, rng)
            except Exception as exc:  # noqa: BLE001 - the contract is "never raise on model output"
                call, issue = None, self._issue("malformed_json", index, body, f"could not be read ({type(exc).__name__})")
            if call is not None:
                turn.calls.append(call)
            if issue is not None:
                turn.issues.append(issue)
        return turn

    def _parse_block(
        self, body: str, closed: bool, index: int, by_name: dict[str, ToolSchema], validators: dict[str, Any],
        rng: random.Random | None,
    ) -> tuple[ToolCall | None, ParseIssue | None]:
        payload, problem = _decode_call_json(body)
        if problem is not None:
            if not closed:
                return None, self._unclosed(index, body, f" and its JSON is incomplete ({problem})")
            return None, self._issue("malformed_json", index, body, problem)
        name = payload.get("name")
        if not isinstance(name, str) or not name.strip():
            return None, self._issue("missing_name", index, body, 'has no "name" (a non-empty string naming the tool)')
        tool = by_name.get(name.strip())
        if tool is None:
            return None, self._unknown_tool(index, body, name, list(by_name))
        arguments, problem = _arguments_of(payload)
        if problem is None:
            problem = _schema_problem(arguments, tool, validators)
        if problem is not None:
            return None, self._invalid_arguments(index, body, tool, problem)
        call = ToolCall(new_call_id(rng), tool.name, arguments, json.dumps(arguments))
        # An unclosed block whose JSON is complete is most likely a generation cut right at the
        # closing tag: run it, but tell the model.
        return call, None if closed else self._unclosed(index, body, "; it was run anyway")

    # -- issues: each message says what is wrong and how to write it instead ---------------------

    def _issue(self, kind: IssueKind, index: int, body: str, problem: str) -> ParseIssue:
        if kind == "malformed_json":
            message = f"Tool call {index} could not be parsed: {problem}. Write {self.SYNTAX} with valid JSON."
        else:
            message = f"Tool call {index} {problem}. Write {self.SYNTAX}."
        return ParseIssue(kind, message, body[:RAW_EXCERPT_CHARS], index)

    def _unclosed(self, index: int, body: str, detail: str) -> ParseIssue:
        message = f"Tool call {index} was not closed with {self.CLOSE}{detail}. Write {self.SYNTAX}."
        return ParseIssue("unclosed_tool_call", message, body[:RAW_EXCERPT_CHARS], index)

    def _unknown_tool(self, index: int, body: str, name: str, available: list[str]) -> ParseIssue:
        listed = ", ".join(available) if available else "none (answer without calling a tool)"
        message = f"Tool call {index} names an unknown tool {_quote(name)}. Available tools: {listed}."
        return ParseIssue("unknown_tool", message, body[:RAW_EXCERPT_CHARS], index)

    def _invalid_arguments(self, index: int, body: str, tool: ToolSchema, problem: str) -> ParseIssue:
        schema = _truncate(json.dumps(tool.parameters, ensure_ascii=False), FEEDBACK_SCHEMA_CHARS)
        message = (
            f"Tool call {index} to {tool.name!r} has invalid arguments: {problem}. "
            f'"arguments" must be a JSON object matching this schema: {schema}'
        )
        return ParseIssue("invalid_arguments", message, body[:RAW_EXCERPT_CHARS], index)

    # -- writing ----------------------------------------------------------------------------------

    def format_instructions(self, tools: list[ToolSchema]) -> str:
        if not tools:
            return ""
        signatures = "\n".join(json.dumps(tool.to_openai(), ensure_ascii=False) for tool in tools)
        example = json.dumps({"name": tools[0].name, "arguments": example_arguments(tools[0].parameters)},
                             ensure_ascii=False)
        one_at_a_time = " Call one tool at a time." if self.stop_at_first_call else ""
        return (
            "You can call tools to help you answer. The tools are described by these JSON schemas, "
            f"inside <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
            "To call a tool, write a JSON object with its name and arguments inside "
            f"<tool_call></tool_call> tags, for example:\n{self.OPEN}{example}{self.CLOSE}\n"
            f"The result comes back inside <tool_response></tool_response>.{one_at_a_time} "
            "When you know the answer, reply with plain text and no tool call."
        )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}{json.dumps(_openai_call_payload(c), ensure_ascii=False)}{self.CLOSE}"
                         for c in calls)

    def format_tool_results(self, outputs: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{output}\n</tool_response>" for output in outputs)


register_parser("smollm", HermesParser)
register_parser("qwen", HermesParser)
register_parser("hermes", HermesParser)


# ---------------------------------------------------------------------------------------------
# Helpers


def new_call_id(rng: random.Random | None = None) -> str:
    """`call_` + 24 hex digits: random, or reproducible from `rng`."""
    return "call_" + (f"{rng.getrandbits(96):024x}" if rng is not None else uuid.uuid4().hex[:24])


def _split_blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """Text outside the blocks, and each block's body with whether it was closed.

    A block runs from an open tag to the next close tag; an open tag met before that close tag
    ends the previous block as unclosed. Linear in len(text) (a regex with a lazy `.*?` goes
    quadratic on many open tags without close tags).
    """
    content: list[str] = []
    blocks: list[tuple[str, bool]] = []
    pos, next_close = 0, -1
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            content.append(text[pos:])
            return content, blocks
        content.append(text[pos:start])
        body_start = start + len(open_tag)
        if next_close != -2 and next_close < body_start:
            next_close = text.find(close_tag, body_start)
            next_close = -2 if next_close < 0 else next_close  # -2: no close tag anywhere after
        next_open = text.find(open_tag, body_start, next_close if next_close >= 0 else len(text))
        if next_open >= 0:
            blocks.append((text[body_start:next_open], False))
            pos = next_open
        elif next_close >= 0:
            blocks.append((text[body_start:next_close], True))
            pos = next_close + len(close_tag)
        else:
            blocks.append((text[body_start:], False))
            return content, blocks


_FENCE_LANGUAGE = re.compile(r"```[A-Za-z]*")


def _strip_fence(source: str) -> str:
    """Drop a Markdown code fence (```json ... ```) that small models like to add."""
    if source.startswith("```"):
        source = source[_FENCE_LANGUAGE.match(source).end():]
    if source.endswith("```"):
        source = source[:-3]
    return source.strip()


def _decode_call_json(body: str) -> tuple[dict[str, Any], str | None]:
    """The block's JSON object, or a description of why it is not one."""
    source = _strip_fence(body.strip())
    if not source:
        return {}, "the block is empty"
    try:
        payload = json.loads(source)
    except json.JSONDecodeError as exc:
        return {}, f"invalid JSON at char {exc.pos} ({exc.msg})"
    except RecursionError:
        return {}, "the JSON is nested too deeply"
    if not isinstance(payload, dict):
        return {}, f"expected a JSON object, got a JSON {_json_type(payload)}"
    if isinstance(payload.get("function"), dict) and "name" not in payload:
        payload = payload["function"]  # an OpenAI-style {"function": {"name", "arguments"}} entry
    return payload, None


def _arguments_of(payload: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        # Some models (and OpenAI's own wire format) write arguments as a JSON-encoded string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return {}, f'"arguments" is a string but not valid JSON (char {exc.pos}: {exc.msg})'
    if not isinstance(arguments, dict):
        return {}, f'"arguments" must be a JSON object, got a JSON {_json_type(arguments)}'
    return arguments, None


def _schema_problem(arguments: dict[str, Any], tool: ToolSchema, validators: dict[str, Any]) -> str | None:
    """The most relevant JSON-schema violation, or None. A tool whose own schema is broken is not
    validated (that is a dataset error, reported at job creation, not the model's fault)."""
    if tool.name not in validators:
        validators[tool.name] = _validator_for(tool.parameters)
    validator = validators[tool.name]
    if validator is None:
        return None
    error = best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = error.json_path.replace("$", "arguments", 1)
    return error.message if where == "arguments" else f"{where}: {error.message}"


def _validator_for(schema: dict[str, Any]) -> Any:
    if not schema:
        return None
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return cls(schema)


def example_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """Placeholder arguments for a schema (its required properties, else its first one), so the
    syntax example in the system prompt is a call the model could actually make."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict) or not properties:
        return {}
    required = [p for p in parameters.get("required") or [] if p in properties] or list(properties)[:1]
    return {name: _placeholder(properties[name]) for name in required}


_PLACEHOLDERS: dict[str, Any] = {"string": "...", "integer": 1, "number": 1.0, "boolean": True, "array": [],
                                 "object": {}, "null": None}


def _placeholder(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return "..."
    if "default" in schema:
        return schema["default"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return _PLACEHOLDERS.get(kind, "...")


def _openai_call_payload(call: dict[str, Any]) -> dict[str, Any]:
    """{"name", "arguments": {...}} from an OpenAI tool_calls entry (arguments may be a string)."""
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # keep the string: the history shows what was sent
    return {"name": function.get("name", ""), "arguments": arguments}


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _quote(name: str) -> str:
    return repr(_truncate(name, 80))


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
