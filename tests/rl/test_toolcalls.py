"""The tool-call parser: what a model's text turns into (runnable calls, problems shown back to
the model), and that no input whatsoever makes it raise."""

from __future__ import annotations

import json
import random
import string
import time

import pytest

from workers.engine.toolcalls import (
    ISSUE_KINDS,
    HermesParser,
    ParsedTurn,
    ToolSchema,
    as_tool_schemas,
    parser_for,
    register_parser,
)

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge base.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
CALCULATOR = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
TOOLS = as_tool_schemas([SEARCH, CALCULATOR])


def parse(text: str, *, seed: int | None = 0) -> ParsedTurn:
    return HermesParser().parse(text, TOOLS, rng=random.Random(seed) if seed is not None else None)


def test_tool_schemas_from_both_openai_formats():
    search, calculator = TOOLS
    assert (search.name, search.description) == ("search", "Search the knowledge base.")
    assert search.parameters["required"] == ["query"]
    assert calculator.name == "calculator" and calculator.parameters["required"] == ["expression"]
    assert search.to_openai() == SEARCH
    for bad in [{"type": "function", "function": {"description": "no name"}}, {"type": "web_search"}, "search"]:
        with pytest.raises(ValueError):
            ToolSchema.from_openai(bad)


def test_plain_answer_has_no_calls_and_no_issues():
    turn = parse("  The capital of France is Paris.\n")
    assert turn.content == "The capital of France is Paris."
    assert turn.calls == [] and turn.issues == [] and turn.parse_errors == 0
    assert turn.error_feedback() == ""


def test_several_calls_in_one_turn_with_whitespace_and_text_around():
    text = (
        "Let me look that up.\n<tool_call>\n  {\"name\": \"search\", \"arguments\": {\"query\": \"Paris\", \"limit\": 2}}\n"
        "</tool_call>\n<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+2\"}}</tool_call>\nDone."
    )
    turn = parse(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("search", {"query": "Paris", "limit": 2}), ("calculator", {"expression": "2+2"})]
    assert turn.content == "Let me look that up.\n\n\nDone."
    assert turn.issues == []
    first = turn.calls[0]
    assert json.loads(first.arguments_json) == first.arguments
    assert first.call_id.startswith("call_") and len({c.call_id for c in turn.calls}) == 2
    assert first.to_openai() == {"id": first.call_id, "type": "function",
                                 "function": {"name": "search", "arguments": first.arguments_json}}


def test_call_ids_are_reproducible_from_a_seed_and_random_without_one():
    text = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    assert parse(text, seed=7).calls[0].call_id == parse(text, seed=7).calls[0].call_id
    assert parse(text, seed=7).calls[0].call_id != parse(text, seed=8).calls[0].call_id
    assert parse(text, seed=None).calls[0].call_id != parse(text, seed=None).calls[0].call_id


def test_arguments_given_as_a_json_string_are_decoded():
    turn = parse('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"weather\\"}"}</tool_call>')
    assert turn.calls[0].arguments == {"query": "weather"} and turn.issues == []


def test_malformed_json_is_reported_with_its_position_and_the_syntax():
    turn = parse('<tool_call>{"name": "search" "arguments": {"query": "x"}}</tool_call>')
    assert turn.calls == []
    [issue] = turn.issues
    assert issue.kind == "malformed_json" and issue.index == 1
    assert "char 18" in issue.message and "Expecting ',' delimiter" in issue.message
    feedback = turn.error_feedback()
    assert "Tool call 1 could not be parsed" in feedback
    assert '<tool_call>{"name": ' in feedback  # tells the model how to write it


def test_unknown_tool_lists_the_available_ones():
    [issue] = parse('<tool_call>{"name": "serch", "arguments": {"query": "x"}}</tool_call>').issues
    assert issue.kind == "unknown_tool"
    assert "'serch'" in issue.message and "search, calculator" in issue.message


def test_wrong_argument_type_is_invalid_arguments_with_the_validators_message():
    turn = parse('<tool_call>{"name": "search", "arguments": {"query": 42}}</tool_call>')
    [issue] = turn.issues
    assert turn.calls == [] and issue.kind == "invalid_arguments"
    assert "42 is not of type 'string'" in issue.message and "arguments.query" in issue.message


def test_missing_required_argument_is_invalid_arguments():
    [issue] = parse('<tool_call>{"name": "search", "arguments": {"limit": 3}}</tool_call>').issues
    assert issue.kind == "invalid_arguments" and "'query' is a required property" in issue.message


def test_missing_name_and_non_object_arguments():
    turn = parse('<tool_call>{"arguments": {"query": "x"}}</tool_call><tool_call>{"name": "search", "arguments": [1]}</tool_call>')
    assert [i.kind for i in turn.issues] == ["missing_name", "invalid_arguments"]
    assert [i.index for i in turn.issues] == [1, 2]
    assert "Tool call 2" in turn.error_feedback()


def test_unclosed_trailing_block_is_still_run_when_its_json_is_complete():
    turn = parse('Searching.\n<tool_call>{"name": "search", "arguments": {"query": "x"}}')
    assert [c.arguments for c in turn.calls] == [{"query": "x"}]
    assert [i.kind for i in turn.issues] == ["unclosed_tool_call"]
    assert turn.content == "Searching."


def test_unclosed_block_with_incomplete_json_is_one_issue():
    turn = parse('<tool_call>{"name": "search", "argum')
    assert turn.calls == [] and [i.kind for i in turn.issues] == ["unclosed_tool_call"]
    assert "incomplete" in turn.issues[0].message


def test_good_call_next_to_bad_ones_is_still_run():
    turn = parse('<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call><tool_call>{bad}</tool_call>')
    assert [c.name for c in turn.calls] == ["search"] and turn.parse_errors == 1
    assert turn.issues[0].index == 2


def test_code_fence_inside_the_block_is_tolerated():
    turn = parse('<tool_call>\n```json\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n```\n</tool_call>')
    assert [c.name for c in turn.calls] == ["calculator"] and turn.issues == []


def test_feedback_lists_at_most_a_few_problems():
    turn = parse("<tool_call>{}</tool_call>" * 50)
    assert turn.parse_errors == 50
    assert turn.error_feedback().count("\n- ") == 6  # five listed, one "and 45 more" line
    assert "45 more" in turn.error_feedback()


def test_format_instructions_describe_every_tool_and_show_a_valid_call():
    parser = HermesParser()
    text = parser.format_instructions(TOOLS)
    assert parser.format_instructions([]) == ""
    assert json.dumps(TOOLS[0].to_openai()) in text and '"calculator"' in text
    example = text.split("<tool_call>", 2)[2].split("</tool_call>")[0]  # the example after the tag names
    call = parser.parse(f"<tool_call>{example}</tool_call>", TOOLS).calls  # the example itself parses
    assert [c.name for c in call] == ["search"]


def test_stop_strings():
    assert HermesParser().stop_strings == ["</tool_call>"]
    assert HermesParser(stop_at_first_call=False).stop_strings == []


def test_parser_registry_by_family():
    assert isinstance(parser_for("SmolLM2-135M-Instruct"), HermesParser)
    assert isinstance(parser_for("tiny-smollm2"), HermesParser)
    assert isinstance(parser_for("Qwen/Qwen2.5-0.5B-Instruct"), HermesParser)
    assert isinstance(parser_for(None), HermesParser)  # the default

    class Marked(HermesParser):
        pass

    register_parser("acme-agent", Marked)
    assert isinstance(parser_for("org/ACME-Agent-7B"), Marked)
    with pytest.raises(ValueError):
        register_parser(" ", Marked)


# ---------------------------------------------------------------------------------------------
# Fuzzing: no input makes the parser raise, and the issue counts add up.

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":", ",", '"search"',
    '"calculator"', '"query"', '"x"', "42", "null", "true", '"', "\\", " ", "\n", "\t", "```json", "```", "é", "日本",
    "🙂", "\ud800", "\x00", '{"name": "search", "arguments": {"query": "q"}}', "<tool_", "call>", "</tool",
]


def random_text(rng: random.Random) -> str:
    pieces = rng.choices(FRAGMENTS, k=rng.randint(0, 40))
    if rng.random() < 0.3:
        pieces.append("".join(rng.choices(string.printable, k=rng.randint(0, 80))))
    rng.shuffle(pieces)
    return "".join(pieces)


def assert_consistent(text: str, turn: ParsedTurn) -> None:
    blocks = text.count("<tool_call>")
    assert all(issue.kind in ISSUE_KINDS for issue in turn.issues)
    assert all(1 <= issue.index <= blocks for issue in turn.issues)
    assert len({issue.index for issue in turn.issues}) == len(turn.issues)  # at most one per block
    # Every block gives a call, an issue, or both (an unclosed block that still ran).
    assert max(len(turn.calls), len(turn.issues)) <= blocks <= len(turn.calls) + len(turn.issues)
    assert all(c.name in {"search", "calculator"} and isinstance(c.arguments, dict) for c in turn.calls)
    assert turn.parse_errors == len(turn.issues)
    assert isinstance(turn.error_feedback(), str) and (turn.error_feedback() == "") == (not turn.issues)
    if blocks == 0:
        assert turn.calls == [] and turn.issues == [] and turn.content == text.strip()


def test_fuzz_random_inputs_never_raise():
    rng = random.Random(20240601)
    parser = HermesParser()
    for _ in range(3000):
        text = random_text(rng)
        assert_consistent(text, parser.parse(text, TOOLS, rng=rng))


@pytest.mark.parametrize("text", [
    "<tool_call>" * 90_000,
    "<tool_call>" * 90_000 + "</tool_call>",
    "<tool_call>" + "[" * 1_000_000 + "</tool_call>",
    '<tool_call>{"name": "search", "arguments": ' + "[" * 100_000 + "</tool_call>",
    "<tool_call>" + "{" * 500_000 + "}" * 500_000 + "</tool_call>",
    '<tool_call>{"name": "search", "arguments": {"query": "' + "é🙂" * 300_000 + '"}}</tool_call>',
    " " * 1_000_000 + "```",
    "".join(random.Random(5).choices("{}[]\":, <tool_call>/" + string.ascii_letters, k=1_000_000)),
], ids=["many-open", "many-open-one-close", "deep-array", "deep-arguments", "braces", "unicode", "spaces", "noise"])
def test_huge_inputs_are_parsed_quickly(text):
    started = time.perf_counter()
    turn = HermesParser().parse(text, TOOLS)
    assert time.perf_counter() - started < 5
    assert_consistent(text, turn)
    assert len(turn.error_feedback()) < 5_000  # the model's next prompt stays small


def test_non_text_input_does_not_raise():
    for value in (None, 12, b"<tool_call>"):
        assert isinstance(HermesParser().parse(value, TOOLS), ParsedTurn)  # type: ignore[arg-type]
