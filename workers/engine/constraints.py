"""Structured outputs on the in-process engine: a JSON schema (or any JSON object) turned into a
token mask for each decoding step, with llguidance (the grammar engine vLLM can use too: a Rust
wheel without dependencies that compiles a schema in milliseconds and masks a step in
microseconds, and answers an uncompilable schema with an error we can name).

`Constraint` is per generated sequence: `allowed(vocab)` the tokens that keep the text inside the
grammar, `advance(token)` after sampling, `finished` once the value is complete (the engine then
ends the sequence as a stop)."""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from typing import Any

import numpy as np


class UnsupportedFormat(ValueError):
    """A response format this engine cannot enforce (a schema llguidance cannot compile, say)."""


def json_grammar(response_format: dict[str, Any], *, call_open: str | None = None) -> str:
    """The llguidance grammar of an OpenAI `response_format` (`json_schema` or `json_object`). With
    `call_open` (the tool-call parser's opening tag), a turn may instead be a tool call, left free
    after its tag: the format constrains the answer, never the calls."""
    import llguidance

    kind = response_format.get("type")
    if kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif kind == "json_schema":
        schema = dict((response_format.get("json_schema") or {}).get("schema") or {})
    else:
        raise UnsupportedFormat(f"response_format type '{kind}' is not a JSON format")
    # Compact JSON: no whitespace between tokens, which a small model could pad forever.
    schema["x-guidance"] = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    lark = f"start: answer\nanswer: %json {json.dumps(schema)}\n"
    if call_open is not None:
        lark = (f"start: answer | call\nanswer: %json {json.dumps(schema)}\n"
                f"call: {json.dumps(call_open)} /(.|\\n)*/\n")
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        first = (messages[0] if messages else "unknown error").splitlines()[0]
        raise UnsupportedFormat(f"the schema cannot be compiled: {first.split(': ', 1)[-1]}")
    return grammar


def unpacked(mask: np.ndarray, size: int) -> np.ndarray:
    """A packed mask (a bit per token id, little-endian, as llguidance computes it) as `size`
    booleans; ids past the packed bits are not allowed."""
    bits = np.unpackbits(mask, bitorder="little").astype(bool)
    allowed = np.zeros(size, dtype=bool)
    n = min(size, bits.shape[0])
    allowed[:n] = bits[:n]
    return allowed


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


class Constraint:
    """One sequence's constraint. On the engine, its matcher masks each step; a vLLM server is sent
    `grammar` instead and enforces it itself (its `guidance` backend is llguidance too), so the
    matcher is only built where it is used."""

    def __init__(self, grammar: str, tokenizer: Any) -> None:
        self.grammar, self._tokenizer = grammar, tokenizer

    @cached_property
    def matcher(self) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(_ll_tokenizer(self._tokenizer), self.grammar, log_level=0)
        if matcher.is_error():
            raise UnsupportedFormat(matcher.get_error())
        return matcher

    def allowed(self, vocab_size: int) -> np.ndarray:
        """A boolean mask over the model's `vocab_size` logits (tokens past the tokenizer's: never)."""
        return unpacked(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), vocab_size)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The value is complete (only the end of the turn may follow), or the matcher failed."""
        return self.matcher.is_stopped() or self.matcher.is_error()


class AnswerFormat:
    """A reinforcement job's `response_format` in its rollouts: every turn is either a tool call,
    free after the parser's opening tag, or the final answer as JSON that fits the format. The
    grammars (with tools to call, and without) are compiled once, when first used; each turn gets
    its own matcher. Chat completions and the Responses API build their constraints with it too."""

    def __init__(self, response_format: dict[str, Any], tokenizer: Any, *, call_open: str | None) -> None:
        self.response_format, self.tokenizer, self.call_open = response_format, tokenizer, call_open
        self.grammars: dict[bool, str] = {}

    @classmethod
    def of(cls, response_format: dict[str, Any] | None, tokenizer: Any, parser: Any) -> AnswerFormat | None:
        """The format to enforce, or None for free text (no format, or `text`)."""
        if not response_format or response_format.get("type") == "text":
            return None
        return cls(response_format, tokenizer, call_open=getattr(parser, "OPEN", None))

    def constraint(self, *, tools: bool) -> Constraint:
        """A new turn's constraint; `tools`: the turn may call a tool instead of answering (where the
        parser has an opening tag). UnsupportedFormat for a schema the engine cannot compile."""
        calls = tools and self.call_open is not None
        if calls not in self.grammars:
            self.grammars[calls] = json_grammar(self.response_format, call_open=self.call_open if calls else None)
        return Constraint(self.grammars[calls], self.tokenizer)

    def masks(self, token_ids: list[int], *, tools: bool) -> list[np.ndarray] | None:
        """The tokens the constraint allowed before each of a turn's sampled tokens, packed (a bit per
        token id, little-endian, as llguidance computes them): replayed over what was sampled, so it
        is the same whichever sampler applied it. The trainer scores the turn under these masks, the
        distribution it was sampled from. None where the tokens do not follow the grammar."""
        matcher = self.constraint(tools=tools).matcher
        masks = []
        for token in token_ids:
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            if token >= mask.size * 8 or not (mask[token >> 3] >> (token & 7)) & 1 or not matcher.consume_token(token):
                return None
            masks.append(mask)
        return masks
