"""Line-by-line checks of a training or validation JSONL file.

Streams the file: memory stays bounded by the longest line, whatever the file's size. A row may
nest at most MAX_JSON_DEPTH (64) levels and hold no NUL character (docs/security.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, BinaryIO

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from app.core.input_limits import MAX_JSON_DEPTH, PROBLEM_MESSAGES, json_problem, worth_walking

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_REPORTED = 5
TOO_DEEP = f"the row is nested more than {MAX_JSON_DEPTH} levels deep"


@dataclass
class RowError:
    line: int
    code: str
    message: str


@dataclass
class FileReport:
    rows: int = 0
    errors: list[RowError] = field(default_factory=list)
    error_count: int = 0

    def add(self, line: int, code: str, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED:
            self.errors.append(RowError(line, code, message))


class RowProblem(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _check_content(i: int, message: dict[str, Any]) -> None:
    content = message.get("content")
    if content is None:
        if message["role"] == "assistant" and message.get("tool_calls"):
            return
        raise RowProblem("invalid_content", f"messages[{i}].content is missing")
    if isinstance(content, str):
        return
    if isinstance(content, list) and content:
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RowProblem("invalid_content", f"messages[{i}].content[{j}] must be an object with a 'type'")
            if part["type"] in ("text", "input_text") and not isinstance(part.get("text"), str):
                raise RowProblem("invalid_content", f"messages[{i}].content[{j}].text must be a string")
        return
    raise RowProblem("invalid_content", f"messages[{i}].content must be a string or a non-empty list of content parts")


def _check_tool_calls(i: int, calls: Any) -> None:
    """An assistant message's OpenAI `tool_calls` (from a caller's own agent loop or a dataset's history)."""
    if not isinstance(calls, list):
        raise RowProblem("invalid_message", f"messages[{i}].tool_calls must be a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RowProblem("invalid_message",
                             f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        if not isinstance(function.get("arguments", "{}"), str):
            raise RowProblem("invalid_message", f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string")


def check_messages(messages: Any, *, last_must_be_user: bool = True) -> None:
    """A conversation in OpenAI's chat format; raises RowProblem naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise RowProblem("missing_messages", "'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowProblem("invalid_message", f"messages[{i}] must be an object")
        if message.get("role") not in ROLES:
            raise RowProblem("invalid_role", f"messages[{i}].role must be one of {', '.join(ROLES)}; got {message.get('role')!r}")
        _check_content(i, message)
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise RowProblem("invalid_message", f"messages[{i}] has role 'tool' but no tool_call_id")
        if message["role"] == "assistant" and message.get("tool_calls") is not None:
            _check_tool_calls(i, message["tool_calls"])
    if last_must_be_user and messages[-1]["role"] != "user":
        raise RowProblem("last_message_not_user", f"the last message must have role 'user', not '{messages[-1]['role']}'")


@lru_cache(maxsize=1024)
def _schema_problem(parameters_json: str) -> str | None:
    """Checking a JSON schema is slow and rows usually repeat the same few: check each once."""
    try:
        Draft202012Validator.check_schema(json.loads(parameters_json))
    except SchemaError as exc:
        return exc.message
    return None


def parameters_schema_problem(parameters: Any) -> str | None:
    """Why `parameters` is not a usable tool-arguments schema, or None."""
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return "must be a JSON schema of type 'object'"
    problem = _schema_problem(json.dumps(parameters, sort_keys=True))
    return f"is not a valid JSON schema: {problem}" if problem else None


def check_tools(tools: Any, declared: set[str] | None) -> None:
    """OpenAI function-tool schemas; `declared`, when given, are the only names allowed."""
    if not isinstance(tools, list):
        raise RowProblem("invalid_tools", "'tools' must be a list")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RowProblem("invalid_tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RowProblem("invalid_tools", f"tools[{i}].function.name must be a non-empty string")
        if name in names:
            raise RowProblem("invalid_tools", f"tools[{i}] repeats the tool name '{name}'")
        names.add(name)
        if declared is not None and name not in declared:
            known = ", ".join(sorted(declared)) or "none"
            raise RowProblem(
                "undeclared_tool",
                f"tools[{i}] names '{name}', which the job does not declare in method.reinforcement.tools (declared: {known})",
            )
        parameters = function.get("parameters")
        problem = parameters_schema_problem(parameters) if parameters is not None else None
        if problem:
            raise RowProblem("invalid_tools", f"tools[{i}].function.parameters {problem}")


def check_row(row: Any, declared_tools: set[str]) -> None:
    if not isinstance(row, dict):
        raise RowProblem("invalid_row", "each line must be a JSON object")
    if "messages" not in row:
        raise RowProblem("missing_messages", "the row has no 'messages'")
    check_messages(row["messages"])
    if "tools" in row:
        check_tools(row["tools"], declared_tools)


def _check_weight(i: int, message: dict[str, Any]) -> None:
    """OpenAI's per-message `weight`: 0 (shown, not trained on) or 1, on assistant messages only."""
    if "weight" not in message:
        return
    if message["role"] != "assistant":
        raise RowProblem("invalid_weight", f"messages[{i}].weight is allowed on assistant messages only")
    weight = message["weight"]
    if type(weight) is not int or weight not in (0, 1):  # not true/false, not 1.0: JSON's 0 or 1
        raise RowProblem("invalid_weight", f"messages[{i}].weight must be 0 or 1; got {weight!r}")


def check_supervised_row(row: Any) -> None:
    """A supervised row, in OpenAI's chat format: a conversation whose assistant messages are the
    answers to learn, at least one of them trained on (weight 1, or no weight)."""
    if not isinstance(row, dict):
        raise RowProblem("invalid_row", "each line must be a JSON object")
    if "messages" not in row:
        raise RowProblem("missing_messages", "the row has no 'messages'")
    messages = row["messages"]
    check_messages(messages, last_must_be_user=False)
    for i, message in enumerate(messages):
        _check_weight(i, message)
    answers = [m for m in messages if m["role"] == "assistant"]
    if not answers:
        raise RowProblem("missing_assistant_message", "the row has no assistant message to train on")
    if all(m.get("weight", 1) == 0 for m in answers):
        raise RowProblem("no_trained_message", "every assistant message has weight 0: nothing to train on")
    if "tools" in row:
        check_tools(row["tools"], None)
    if "parallel_tool_calls" in row and not isinstance(row["parallel_tool_calls"], bool):
        raise RowProblem("invalid_row", "'parallel_tool_calls' must be true or false")


# A preference row's two answers, by OpenAI's current names and the older ones it still accepts.
PREFERENCE_FIELDS = (("preferred_output", "preferred_completion"), ("non_preferred_output", "non_preferred_completion"))


def check_preference_row(row: Any) -> None:
    """A preference row, in OpenAI's DPO format: `input` (`messages`, optional `tools` and
    `parallel_tool_calls`), then one assistant message preferred and one not (`preferred_output`
    and `non_preferred_output`, or the older `*_completion` names), which may call tools."""
    if not isinstance(row, dict):
        raise RowProblem("invalid_row", "each line must be a JSON object")
    source = row.get("input")
    if not isinstance(source, dict):
        raise RowProblem("missing_input", "the row has no 'input' object ({'messages': [...]})")
    _renamed(("messages", "input.messages"), check_messages, source.get("messages"), last_must_be_user=False)
    if source["messages"][-1]["role"] == "assistant":
        raise RowProblem("invalid_input", "input.messages must end with the turn to answer (user or tool), "
                                          "not an assistant message")
    if "tools" in source:
        _renamed(("tools", "input.tools"), check_tools, source["tools"], None)
    if "parallel_tool_calls" in source and not isinstance(source["parallel_tool_calls"], bool):
        raise RowProblem("invalid_row", "'input.parallel_tool_calls' must be true or false")
    answers = [_preference_answer(row, names) for names in PREFERENCE_FIELDS]
    if answers[0] == answers[1]:
        raise RowProblem("identical_outputs", "the preferred and non-preferred outputs are the same: "
                                              "the pair teaches nothing")


def _preference_answer(row: dict[str, Any], names: tuple[str, str]) -> dict[str, Any]:
    name = next((n for n in names if n in row), None)
    if name is None:
        raise RowProblem("missing_output", f"the row has no '{names[0]}'")
    answer = row[name]
    if not isinstance(answer, list) or len(answer) != 1:
        raise RowProblem("invalid_output", f"'{name}' must be a list of exactly one assistant message")
    _renamed(("messages", name), check_messages, answer, last_must_be_user=False)
    if answer[0]["role"] != "assistant":
        raise RowProblem("invalid_output", f"{name}[0].role must be 'assistant'")
    return answer[0]


def _renamed(words: tuple[str, str], check: Callable[..., None], value: Any, *args: Any, **kwargs: Any) -> None:
    """`check`, its problem worded for where the value sits in a preference row: `words` (old, new)
    renames the first mention, e.g. `messages[0]` to `input.messages[0]`."""
    try:
        check(value, *args, **kwargs)
    except RowProblem as problem:
        raise RowProblem(problem.code, problem.message.replace(*words, 1)) from None


RowRule = Callable[[Any], None]


def row_rule(method_type: str, declared_tools: set[str]) -> RowRule:
    """How a row of a job's files is checked: its method's rule (app/jobs/methods/)."""
    from app.jobs.methods import METHODS  # the methods' rules are built from this module's checks

    return METHODS[method_type].row_rule(declared_tools)


def _json_problem(raw: bytes, row: Any) -> tuple[str, str] | None:
    """(code, message) for a row nested too deep, or with a NUL or an unpaired surrogate in a string
    (PostgreSQL's JSONB cannot hold a NUL, and a surrogate cannot be encoded for it or for a
    tokenizer: the row could never be trained on), else None."""
    walk, nul, surrogates = worth_walking(raw)
    problem = json_problem(row, nul=nul, surrogates=surrogates) if walk else None
    if problem is None:
        return None
    kind, where = problem
    if kind == "too_deep":
        return "too_deep", TOO_DEEP
    return "invalid_value", f"{where or 'the row'} {PROBLEM_MESSAGES[kind]}"


def validate_jsonl(fh: BinaryIO, *, declared_tools: set[str], method_type: str = "reinforcement") -> FileReport:
    check = row_rule(method_type, declared_tools)
    report = FileReport()
    line_no = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            break
        line_no += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            report.add(line_no, "line_too_long", f"the line is longer than {MAX_LINE_BYTES} bytes")
            while raw and not raw.endswith(b"\n"):  # skip the rest of the over-long line
                raw = fh.readline(MAX_LINE_BYTES)
            continue
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except UnicodeDecodeError:
            report.add(line_no, "invalid_encoding", "the line is not valid UTF-8")
            continue
        except json.JSONDecodeError as exc:
            report.add(line_no, "invalid_json", f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        except RecursionError:  # deeper than the parser recurses (about 1,000 levels)
            report.add(line_no, "too_deep", TOO_DEEP)
            continue
        if (problem := _json_problem(raw, row)) is not None:
            report.add(line_no, *problem)
            continue
        try:
            check(row)
        except RowProblem as problem:
            report.add(line_no, problem.code, problem.message)
            continue
        report.rows += 1
    return report
