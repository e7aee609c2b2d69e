"""OpenAI's preference rows as token sequences: the conversation (`input.messages`, `input.tools`)
followed by each answer, rendered exactly as a supervised row (workers/methods/supervised/data.py) and so as the
rollout engine renders a conversation. Only the answer's tokens carry loss; assistant turns inside
`input` are context. The older field names `preferred_completion` and `non_preferred_completion`
are read too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.engine.prompting import ChatFormatter
from workers.training.sequences import TrainSequence
from workers.methods.supervised.data import BadExample, render_example

ANSWERS = (("preferred_output", "preferred_completion"), ("non_preferred_output", "non_preferred_completion"))


@dataclass
class Pair:
    """One preference row: the preferred and the non-preferred sequence, and their log-probs under
    the reference model (summed over the answer's tokens; set before the first step)."""

    chosen: TrainSequence
    rejected: TrainSequence
    reference: tuple[float, float] | None = None

    @property
    def tokens(self) -> int:
        return len(self.chosen.token_ids) + len(self.rejected.token_ids)


@dataclass
class Pairs:
    pairs: list[Pair]
    truncated: int  # rows with an answer cut at max_tokens


def pairs_from_rows(rows: list[dict[str, Any]], formatter: ChatFormatter, *, max_tokens: int, source: str) -> Pairs:
    """Every row as a pair; BadExample naming the file and line of the first row the chat template
    cannot render."""
    pairs, truncated = [], 0
    for line, row in enumerate(rows, start=1):
        try:
            sequences = [_sequence(formatter, row, names) for names in ANSWERS]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise BadExample(f"{source} file, line {line}: {exc}") from exc
        cut = [_cut(sequence, max_tokens) for sequence in sequences]
        truncated += any(len(s.token_ids) > max_tokens for s in sequences)
        pairs.append(Pair(*cut))
    return Pairs(pairs, truncated)


def _sequence(formatter: ChatFormatter, row: dict[str, Any], names: tuple[str, str]) -> TrainSequence:
    source = row["input"]
    context = [{**m, "weight": 0} if m.get("role") == "assistant" else m for m in source["messages"]]
    answer = next(row[name] for name in names if name in row)[0]
    ids, mask = render_example(formatter, {"messages": [*context, {**answer, "weight": 1}],
                                           "tools": source.get("tools")})
    return TrainSequence(ids, mask, [0.0] * len(ids), 0.0)


def _cut(sequence: TrainSequence, max_tokens: int) -> TrainSequence:
    if len(sequence.token_ids) <= max_tokens:
        return sequence
    return TrainSequence(sequence.token_ids[:max_tokens], sequence.loss_mask[:max_tokens],
                         sequence.sampling_logprobs[:max_tokens], 0.0)
