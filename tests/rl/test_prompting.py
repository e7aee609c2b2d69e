"""Chat formatting with SmolLM2's real tokenizer: tools in the prompt, tool results and feedback
between turns, and token-in/token-out continuation (the model's own token ids are kept, and the
running sequence always decodes to the rendered conversation)."""

from __future__ import annotations

import json

import pytest

from workers.models.registry import packaged_gguf_path
from workers.engine.prompting import (
    ChatFormatter,
    ChatTemplateError,
    assistant_message,
    feedback_message,
    tool_result_message,
)
from workers.engine.toolcalls import HermesParser, as_tool_schemas

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER]

# A small ChatML template that renders `tools` itself (as Qwen2.5's does) and has a `tool` role.
NATIVE_TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A template whose rendering of earlier turns depends on how many messages follow.
COUNTING_TEMPLATE = (
    "{{ '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = packaged_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def formatter(tokenizer):
    return ChatFormatter(tokenizer, HermesParser())


def question():
    return [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


def test_smollm2_template_has_no_tool_support_so_tools_go_into_the_system_prompt(formatter):
    assert formatter.supports_tools is False
    text = formatter.render(question(), TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    assert json.dumps(WEATHER) in system  # the full schema
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "..."}}</tool_call>' in system
    assert "SmolLM" not in text  # our system message replaces the template's default one
    assert text.endswith("<|im_start|>user\nWhat is the weather in Paris and in Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_instructions_come_before_the_conversations_own_system_message(formatter):
    messages = [{"role": "system", "content": "You are a travel agent."}, *question()]
    system = formatter.render(messages, TOOLS).split("<|im_end|>")[0]
    assert system.index("<tools>") < system.index("You are a travel agent.")
    assert system.count("<|im_start|>system") == 1


def test_a_system_message_that_already_shows_the_call_syntax_is_kept_as_written(formatter, tokenizer):
    own = 'Example:\nUser: Foo revenue?\nAssistant: <tool_call>{"name": "search", "arguments": {"query": "Foo"}}</tool_call>'
    rendered = formatter.render([{"role": "system", "content": own}, *question()], TOOLS)
    expected = tokenizer.apply_chat_template([{"role": "system", "content": own}, *question()], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == expected and "<tools>" not in rendered


def test_without_tools_the_template_is_used_unchanged(formatter, tokenizer):
    messages = [{"role": "developer", "content": "Be brief."}, *question()]
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *question()],
                                             tokenize=False, add_generation_prompt=True)
    assert formatter.render(messages, None) == expected
    assert formatter.render(messages, []) == expected


def test_prompt_ids_decode_back_to_the_rendered_text(formatter, tokenizer):
    ids = formatter.prompt_ids(question(), TOOLS)
    assert tokenizer.decode(ids, skip_special_tokens=False) == formatter.render(question(), TOOLS)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_tool_results_are_one_user_message_of_tool_responses(formatter):
    calls = HermesParser().parse(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', as_tool_schemas(TOOLS)).calls
    messages = [*question(), assistant_message("(calls)"),
                tool_result_message(calls[0], "18C, sunny"), tool_result_message(calls[1], "24C, clear")]
    text = formatter.render(messages, TOOLS)
    assert ("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n"
            "<tool_response>\n24C, clear\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text


def test_dataset_assistant_tool_calls_are_written_in_the_models_call_syntax(formatter):
    history = [*question(), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    text = formatter.render(history, TOOLS)
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in text


def test_turn_end_stop_tokens_and_closing_a_turn(formatter, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert formatter.decode(formatter.turn_end_ids()) == "<|im_end|>\n"
    assert formatter.turn_end_ids()[0] == im_end
    assert im_end in formatter.stop_token_ids()
    reply = formatter.encode("Sunny.")
    assert formatter.close_turn_ids(reply) == formatter.turn_end_ids()  # stopped on a stop string / cap
    assert formatter.close_turn_ids(reply + [im_end]) == formatter.turn_end_ids()[1:]  # stopped on <|im_end|>
    assert formatter.assistant_text(reply + [im_end]) == "Sunny."


def char_by_char_ids(formatter, text):
    """Ids a sampler could produce that are NOT the tokenizer's own split of the text."""
    return [i for ch in text for i in formatter.encode(ch)]


def test_multi_turn_rollout_keeps_generated_ids_and_matches_the_full_render(formatter, tokenizer):
    """user → assistant (tool call, stopped on </tool_call>) → tool result → assistant (broken
    call) → error feedback → assistant (call) → tool result + budget notice → assistant (answer,
    stopped on <|im_end|>)."""
    parser, schemas = formatter.parser, as_tool_schemas(TOOLS)
    messages = question()
    ids = formatter.prompt_ids(messages, TOOLS)
    kept = []  # (offset, generated ids) — the model's tokens must survive untouched

    def model_turn(generated):
        kept.append((len(ids), list(generated)))
        text = formatter.assistant_text(generated)
        ids.extend(generated + formatter.close_turn_ids(generated))
        messages.append(assistant_message(text))
        return parser.parse(text, schemas)

    def environment_turn(new_messages):
        ids.extend(formatter.continuation_ids(messages, new_messages, TOOLS))
        messages.extend(new_messages)
        assert formatter.decode(ids) == formatter.render(messages, TOOLS)  # ready for the next turn

    turn = model_turn(formatter.encode('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'))
    environment_turn([tool_result_message(turn.calls[0], "18C, sunny")])

    turn = model_turn(formatter.encode('<tool_call>{"name": "get_weather", "arguments": {"city": Rome}}</tool_call>'))
    assert turn.calls == [] and turn.parse_errors == 1
    environment_turn([feedback_message(turn.error_feedback())])

    turn = model_turn(char_by_char_ids(
        formatter, 'Now Rome.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'))
    assert [c.arguments for c in turn.calls] == [{"city": "Rome"}]
    environment_turn([tool_result_message(turn.calls[0], "24C, clear"), feedback_message("You have 1 tool call left.")])

    model_turn(formatter.encode("Paris: 18C and sunny. Rome: 24C and clear.") + [tokenizer.eos_token_id])

    full = formatter.render(messages, TOOLS, add_generation_prompt=False)
    assert formatter.decode(ids) == full
    assert "<|im_start|>user\n<tool_response>\n24C, clear\n</tool_response><|im_end|>\n<|im_start|>user\nYou have 1 tool call left." in full
    for offset, generated in kept:
        assert ids[offset:offset + len(generated)] == generated
    # Turns sampled as the tokenizer would split them give exactly the tokenization of the render
    # (ChatML's special tokens make every message start a token boundary); the char-by-char turn
    # differs only inside itself.
    reference = formatter.encode(full)
    offset, odd = kept[2]
    assert ids[:offset] == reference[:offset]
    tail = len(ids) - offset - len(odd)
    assert ids[-tail:] == reference[-tail:]


def test_template_with_tool_support_is_used_natively(tokenizer):
    formatter = ChatFormatter(tokenizer, HermesParser(), chat_template=NATIVE_TOOLS_TEMPLATE)
    assert formatter.supports_tools is True
    messages = [{"role": "system", "content": "You are a travel agent."}, *question()]
    text = formatter.render(messages, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a travel agent.\n\n# Tools\n<tools>\n")
    assert '"name": "get_weather"' in text
    assert "You can call tools" not in text  # our instructions are not added on top
    call = HermesParser().parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
                                as_tool_schemas(TOOLS)).calls[0]
    ids = formatter.prompt_ids(messages, TOOLS)
    generated = formatter.encode('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    ids += generated + formatter.close_turn_ids(generated)
    messages.append(assistant_message(formatter.assistant_text(generated)))
    result = [tool_result_message(call, "18C")]
    ids += formatter.continuation_ids(messages, result, TOOLS)
    assert formatter.decode(ids).endswith("<|im_start|>tool\n18C<|im_end|>\n<|im_start|>assistant\n")
    assert formatter.decode(ids) == formatter.render(messages + result, TOOLS)


def test_template_that_rewrites_earlier_turns_is_refused_with_a_clear_error(tokenizer):
    formatter = ChatFormatter(tokenizer, HermesParser(), chat_template=COUNTING_TEMPLATE)
    messages = [*question(), assistant_message("Let me check.")]
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
        formatter.continuation_ids(messages, [feedback_message("Go on.")], TOOLS)


def test_bad_messages_get_clear_errors(formatter):
    with pytest.raises(ValueError, match="list"):
        formatter.render("hello", TOOLS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="message 1 must be an object"):
        formatter.render([*question(), {"content": "no role"}], TOOLS)
    with pytest.raises(ValueError, match="only text"):
        formatter.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], TOOLS)
    with pytest.raises(ValueError, match="must end with the model's"):
        formatter.continuation_ids(question(), [feedback_message("hi")], TOOLS)
    with pytest.raises(ValueError, match="name"):
        formatter.render(question(), [{"type": "function", "function": {}}])


def test_text_content_parts_are_joined(formatter):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the weather "},
                                          {"type": "input_text", "text": "in Paris and in Rome?"}]}]
    assert formatter.render(parts, TOOLS) == formatter.render(question(), TOOLS)


def test_message_builders():
    call = HermesParser().parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                                as_tool_schemas(TOOLS)).calls[0]
    assert tool_result_message(call, "-2C") == {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather",
                                                "content": "-2C"}
    assert feedback_message("Fix it.") == {"role": "user", "content": "Fix it."}
    assert assistant_message("raw") == {"role": "assistant", "content": "raw"}


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    class NoTemplate:
        chat_template = None
        name_or_path = "plain-lm"

    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormatter(NoTemplate())
