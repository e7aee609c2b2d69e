"""OpenAI's chat JSONL (`messages`, `tools`, per-assistant `weight`) as token ids and a loss mask,
rendered exactly as the rollout engine renders a conversation (workers/engine/prompting.py):

- the context before an assistant turn is `prompt_ids` (the first) or `continuation_ids` (tool
  results and user turns after an earlier one), with the same tool instructions;
- an assistant turn is its text as the model writes it (`assistant_turn_text`: content, then
  `tool_calls` in the parser's syntax), then the template's turn end. The loss covers the turn's
  tokens and the end-of-turn token the model samples to stop. A turn that ends on the parser's
  stop string (a tool call: generation stops there) learns no end-of-turn token, as a rollout
  never samples one there; the rest of the turn end is context.

So what supervised training teaches is what a rollout produces and the parser reads. Assistant
messages with `weight: 0` are context only. A row longer than `max_tokens` is cut at that length
(OpenAI truncates over-long examples) and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.engine.prompting import ChatFormatter
from workers.training.sequences import TrainSequence


class BadExample(ValueError):
    """A row that cannot be rendered for this model; the message names its line."""


@dataclass
class Examples:
    sequences: list[TrainSequence]
    truncated: int  # rows cut at max_tokens
    trained_tokens: int  # tokens with loss, over all rows


def examples_from_rows(rows: list[dict[str, Any]], formatter: ChatFormatter, *, max_tokens: int,
                       source: str) -> Examples:
    """Every row as a training sequence; BadExample naming the file and line of the first row the
    chat template cannot render."""
    sequences, truncated = [], 0
    for line, row in enumerate(rows, start=1):
        try:
            ids, mask = render_example(formatter, row)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadExample(f"{source} file, line {line}: {exc}") from exc
        if len(ids) > max_tokens:
            ids, mask, truncated = ids[:max_tokens], mask[:max_tokens], truncated + 1
        sequences.append(TrainSequence(ids, mask, [0.0] * len(ids), 0.0))
    return Examples(sequences, truncated, sum(sum(s.loss_mask[1:]) for s in sequences))


def render_example(formatter: ChatFormatter, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The row's token ids and loss mask (1 on the tokens of assistant turns with weight 1)."""
    messages, tools = row["messages"], row.get("tools")
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ValueError("the row has no assistant message to learn from")
    ids: list[int] = []
    mask: list[int] = []
    done = 0  # messages rendered so far
    for i in range(last + 1):
        if messages[i].get("role") != "assistant":
            continue
        context = (formatter.continuation_ids(messages[:done], messages[done:i], tools) if ids
                   else formatter.prompt_ids(messages[:i], tools))
        turn, learned = _assistant_turn(formatter, messages[i])
        weight = int(messages[i].get("weight", 1))
        ids += context + turn
        mask += [0] * len(context) + [weight] * learned + [0] * (len(turn) - learned)
        done = i + 1
    return ids, mask


def _assistant_turn(formatter: ChatFormatter, message: dict[str, Any]) -> tuple[list[int], int]:
    """The turn's ids (text and turn end) and how many of them the model samples (the loss's)."""
    text = formatter.assistant_turn_text(message)
    written = formatter.encode(text)
    closing = formatter.turn_end_ids()
    stops_on_string = any(text.endswith(stop) for stop in formatter.parser.stop_strings)
    samples_end = bool(closing) and not stops_on_string and closing[0] in formatter.stop_token_ids()
    return written + closing, len(written) + (1 if samples_end else 0)
