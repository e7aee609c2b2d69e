"""Chat formatting for rollouts: messages + tool schemas → prompt text → token ids, and the
token ids to append between model turns without ever re-tokenizing what the model generated
(token-in/token-out: the tokens sampled are the tokens trained on).

How a conversation is rendered
- Tools. When the tokenizer's chat template renders the `tools` argument (Qwen2.5 and most
  tool-trained models), it is used natively. Otherwise (SmolLM2 and most small models) the
  parser's `format_instructions(tools)` is put at the start of the system message (one is added
  when the conversation has none).
- Assistant turns are rendered as their raw text, i.e. the model's own `<tool_call>` blocks, so
  the rendered conversation is exactly what the model saw and produced. Build them with
  `assistant_message(text)`. An assistant message from a dataset that carries OpenAI `tool_calls`
  instead has those calls written in the parser's syntax after its content.
- Tool results (`tool_result_message`). With a template that renders tools, as `tool` role
  messages (the template knows its own convention). Without, consecutive tool results become ONE
  `user` message of `<tool_response>\\n...\\n</tool_response>` blocks (Hermes/Qwen convention):
  a model whose template has no tool role was never trained on one, and strict templates reject
  unknown roles.
- Error feedback and budget notices (`feedback_message`) are `user` messages.

Token-in/token-out, for the rollout engine
1. `ids = prompt_ids(messages, tools)`; generate with `stop_token_ids()` and the parser's
   `stop_strings`, keep the generated ids G exactly as sampled.
2. `text = assistant_text(G)`; `ids += G + close_turn_ids(G)` (closes the assistant turn when
   generation stopped on a stop string or the token cap instead of the end-of-turn token);
   append `assistant_message(text)` to the messages.
3. For the tool results / feedback that follow: `ids += continuation_ids(messages, new, tools)`;
   `messages += new`; generate again from `ids`.
Then `decode(ids) == render(messages)` at every step, while the model's tokens are untouched.
"""

from __future__ import annotations

from typing import Any

from workers.engine.toolcalls import ToolCall, ToolCallParser, ToolSchema, as_tool_schemas, parser_for

# Names no real conversation uses, for probing what a template does.
_PROBE_TOOL = ToolSchema("agent_rft_probe_tool", "Probe tool.", {"type": "object", "properties": {}})
_PROBE_REPLY = "agent-rft-probe-reply"
_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


class ChatTemplateError(ValueError):
    """The chat template cannot render this conversation, or cannot be used token-in/token-out."""


class ChatFormatter:
    """Renders conversations with a tokenizer's chat template and one tool-call parser."""

    def __init__(self, tokenizer: Any, parser: ToolCallParser | None = None, *, chat_template: str | None = None):
        """`chat_template` overrides the tokenizer's own (a Jinja string, as in Hugging Face)."""
        self.tokenizer = tokenizer
        self.parser = parser or parser_for(getattr(tokenizer, "name_or_path", None), tokenizer)
        self.chat_template = chat_template
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!r} has no chat template; "
                "pass chat_template= to ChatFormatter"
            )
        self.supports_tools = self._template_renders_tools()
        self._turn_end_text = self._template_turn_end()
        self._turn_end_ids = self.encode(self._turn_end_text)

    # -- rendering --------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[ToolSchema | dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The conversation as the model sees it (see the module docstring for the conventions)."""
        schemas = as_tool_schemas(tools)
        conversation = self._prepare(messages, schemas)
        return self._apply_template(conversation, schemas if self.supports_tools else [], add_generation_prompt)

    def _prepare(self, messages: list[dict[str, Any]], tools: list[ToolSchema]) -> list[dict[str, Any]]:
        """OpenAI-style messages → what the template gets: plain-text content, assistant turns as
        raw text, tool results in the template's convention, tool instructions in the system
        message when the template cannot render tools."""
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
        prepared: list[dict[str, Any]] = []
        pending_results: list[str] = []
        for position, message in enumerate(messages):
            role, content = _role_and_text(message, position)
            if role == "tool" and not self.supports_tools:
                pending_results.append(content)
                continue
            if pending_results:
                prepared.append({"role": "user", "content": self.parser.format_tool_results(pending_results)})
                pending_results = []
            prepared.append(self._prepared_message(message, role, content))
        if pending_results:
            prepared.append({"role": "user", "content": self.parser.format_tool_results(pending_results)})
        if tools and not self.supports_tools and not self._system_explains_calls(prepared):
            _put_in_system_message(prepared, self.parser.format_instructions(tools))
        return prepared

    def _system_explains_calls(self, conversation: list[dict[str, Any]]) -> bool:
        """A dataset whose system message already shows the call syntax (e.g. a worked example)
        is left as its author wrote it: small models follow one concrete example far better
        than generic instructions (measured with SmolLM2-135M: docs/rollouts.md)."""
        marker = getattr(self.parser, "OPEN", None)
        return bool(marker and conversation and conversation[0]["role"] == "system"
                    and marker in conversation[0]["content"])

    def _prepared_message(self, message: dict[str, Any], role: str, content: str) -> dict[str, Any]:
        if role == "assistant" and message.get("tool_calls"):
            calls = self.parser.format_calls(list(message["tool_calls"]))
            content = f"{content}\n{calls}" if content else calls
        if role == "tool":
            # Templates that render tools may use the call's id or the tool's name.
            extra = {k: message[k] for k in ("tool_call_id", "name") if k in message}
            return {"role": "tool", "content": content, **extra}
        return {"role": role, "content": content}

    def _apply_template(self, conversation: list[dict[str, Any]], tools: list[ToolSchema],
                        add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = [tool.to_openai() for tool in tools]
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            text = self.tokenizer.apply_chat_template(conversation, **kwargs)
        except Exception as exc:  # jinja2 errors, raise_exception() calls inside templates, ...
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def assistant_turn_text(self, message: dict[str, Any]) -> str:
        """An assistant message as the model writes its turn: the content, then its OpenAI
        `tool_calls` in the parser's syntax (what a rollout samples and the parser reads)."""
        role, content = _role_and_text(message, 0)
        return self._prepared_message(message, role, content)["content"]

    # -- what the template can do (probed once) ---------------------------------------------------

    def _template_renders_tools(self) -> bool:
        """True when passing `tools` changes the rendering and the tool's name shows up in it;
        SmolLM2's template ignores `tools`. A template that fails on the probe has no support."""
        probe = [{"role": "user", "content": "Hi"}]
        try:
            without = self._apply_template(probe, [], add_generation_prompt=True)
            with_tools = self._apply_template(probe, [_PROBE_TOOL], add_generation_prompt=True)
        except ChatTemplateError:
            return False
        return with_tools != without and _PROBE_TOOL.name in with_tools

    def _template_turn_end(self) -> str:
        """The text the template writes after an assistant message's content (ChatML:
        "<|im_end|>\\n")."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
        text = self._apply_template(probe, [], add_generation_prompt=False)
        at = text.rfind(_PROBE_REPLY)
        if at < 0:
            raise ChatTemplateError("the chat template drops the content of assistant messages")
        return text[at + len(_PROBE_REPLY):]

    # -- token ids --------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        # The rendered text already holds every special token the template wants (BOS included).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[ToolSchema | dict[str, Any]] | None = None) -> list[int]:
        """The initial prompt, ending with the generation prompt (ChatML: "<|im_start|>assistant\\n")."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def continuation_ids(self, messages_before: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                         tools: list[ToolSchema | dict[str, Any]] | None = None) -> list[int]:
        """Ids to append after a closed assistant turn (see `close_turn_ids`) for `new_messages`
        (tool results, feedback, notices) plus the next generation prompt.

        `messages_before` is the conversation so far and must end with the model's turn. Only the
        text the new messages add is tokenized; raises ChatTemplateError when the template renders
        the earlier conversation differently once more messages follow (then no suffix exists).
        """
        if not messages_before or not isinstance(messages_before[-1], dict) or messages_before[-1].get("role") != "assistant":
            raise ValueError("continuation_ids: messages_before must end with the model's (assistant) turn")
        before = self.render(messages_before, tools, add_generation_prompt=False)
        after = self.render(list(messages_before) + list(new_messages), tools, add_generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise ChatTemplateError(
                "the chat template rewrites earlier turns when messages are added (it differs at char "
                f"{at}: {before[at:at + 40]!r} became {after[at:at + 40]!r}), so the conversation cannot be "
                "extended token-in/token-out; use a template whose rendering of a conversation is a prefix "
                "of the rendering of any longer one"
            )
        suffix = after[len(before):]
        ids = self.encode(suffix)
        if self.decode(ids) != suffix:
            raise ChatTemplateError(
                "the tokenizer does not reproduce a continuation of the conversation when decoding it "
                f"({suffix[:60]!r}); this tokenizer cannot be used token-in/token-out"
            )
        return ids

    def turn_end_ids(self) -> list[int]:
        """The ids that close an assistant turn (SmolLM2: `<|im_end|>` and a newline)."""
        return list(self._turn_end_ids)

    def close_turn_ids(self, generated_ids: list[int]) -> list[int]:
        """What to append to the generated ids so the assistant turn is closed: all of
        `turn_end_ids()` after a stop string or the token cap, the rest of it (SmolLM2: the
        newline) when generation already ended with the end-of-turn token."""
        return self._turn_end_ids[_overlap(generated_ids, self._turn_end_ids):]

    def assistant_text(self, generated_ids: list[int]) -> str:
        """The assistant message's content for these generated ids: their exact decoding, without
        the end-of-turn token(s) the template writes itself."""
        ids = list(generated_ids)
        return self.decode(ids[:len(ids) - _overlap(ids, self._turn_end_ids)])

    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a model turn: the tokenizer's EOS and the template's end-of-turn token."""
        stops = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        stops.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        if self._turn_end_ids and self._turn_end_ids[0] in special:
            stops.add(self._turn_end_ids[0])
        return frozenset(stops)


# ---------------------------------------------------------------------------------------------
# Message builders


def assistant_message(text: str) -> dict[str, Any]:
    """The model's turn, as its raw generated text (tool-call blocks included)."""
    return {"role": "assistant", "content": text}


def tool_result_message(call: ToolCall, output: str) -> dict[str, Any]:
    """A tool's output for `call` (rendered per the template, see the module docstring)."""
    return {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": output}


def feedback_message(text: str) -> dict[str, Any]:
    """A note to the model from the environment: parse errors, budget notices."""
    return {"role": "user", "content": text}


QUESTION_ECHO_CHARS = 500


def budget_spent_message(messages: list[dict[str, Any]]) -> str:
    """What the policy reads once its tool-call budget is spent: answer now, and the question again.

    Repeating the last user message (cut at QUESTION_ECHO_CHARS) keeps a small model on the task:
    SmolLM2-135M, told only "answer now" after a search result, mostly answered with noise or a copy
    of the result; with the question repeated it answered the question (docs/rollouts.md)."""
    question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
    text = "You have used all your tool calls. Answer now, without calling tools."
    if isinstance(question, str) and question.strip():
        question = question.strip()
        if len(question) > QUESTION_ECHO_CHARS:
            question = question[:QUESTION_ECHO_CHARS].rstrip() + "…"
        text += f" The question: {question}"
    return text


# ---------------------------------------------------------------------------------------------
# Helpers


def _role_and_text(message: Any, position: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {position} must be an object with a string 'role'")
    role = "system" if message["role"] == "developer" else message["role"]  # OpenAI's newer name
    return role, _content_text(message.get("content"), position)


def _content_text(content: Any, position: int) -> str:
    """Plain text from a string, None, or a list of OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PART_TYPES:
                raise ValueError(f"message {position}: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"message {position}: content must be a string or a list of text parts")


def _put_in_system_message(conversation: list[dict[str, Any]], instructions: str) -> None:
    """Tool instructions first in the system message, the conversation's own system text after."""
    if conversation and conversation[0]["role"] == "system":
        own = conversation[0]["content"]
        conversation[0] = {"role": "system", "content": f"{instructions}\n\n{own}" if own else instructions}
    else:
        conversation.insert(0, {"role": "system", "content": instructions})


def _overlap(ids: list[int], turn_end: list[int]) -> int:
    """How many leading ids of `turn_end` the sequence already ends with."""
    for size in range(min(len(ids), len(turn_end)), 0, -1):
        if list(ids[-size:]) == list(turn_end[:size]):
            return size
    return 0


__all__ = [
    "ChatFormatter", "ChatTemplateError", "assistant_message", "budget_spent_message", "feedback_message",
    "tool_result_message",
]
