"""The data a run trains on: JSONL rows as prompts, the seeded stream of batches (a permutation
per epoch, resumable from a DataPosition), and the seeds of every rollout, derived from
(seed, step, slot, row, k) and never from global RNG state, so a resumed run samples exactly
what an uninterrupted one does."""

from __future__ import annotations

import math

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from workers.engine.rollout import RolloutSpec
from workers.engine.toolcalls import ToolSchema
from workers.training.training_state import DataPosition

ROW_KEYS = ("messages", "tools")  # every other key of a JSONL row is the item
T = TypeVar("T")


@dataclass
class Prompt:
    row_index: int
    messages: list[dict[str, Any]]
    tools: list[ToolSchema]
    item: dict[str, Any]


def job_tool_schemas(job_tools: Sequence[Any]) -> list[ToolSchema]:
    """Schemas of the job's tools that carry a description or parameters (the extension)."""
    schemas = []
    for tool in job_tools or []:
        get = tool.get if isinstance(tool, Mapping) else lambda key, t=tool: getattr(t, key, None)
        if get("parameters") or get("description"):
            parameters = get("parameters") or {"type": "object", "properties": {}}
            schemas.append(ToolSchema(get("name"), get("description") or "", parameters))
    return schemas


def prompts_from_rows(rows: Sequence[dict], job_schemas: list[ToolSchema], *, source: str) -> list[Prompt]:
    """JSONL rows → prompts; a row's own `tools` win over the job's schemas."""
    prompts = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise ValueError(f"{source} row {index + 1}: needs a non-empty 'messages' list")
        try:
            tools = [ToolSchema.from_openai(t) for t in row["tools"]] if "tools" in row else job_schemas
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source} row {index + 1}: invalid 'tools': {exc}") from exc
        item = {key: value for key, value in row.items() if key not in ROW_KEYS}
        prompts.append(Prompt(index, row["messages"], tools, item))
    return prompts


def epoch_permutation(n_rows: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_rows))
    random.Random(f"agent-rft/{seed}/epoch/{epoch}").shuffle(order)  # str seeds hash the same in every process
    return order


def fixed_subset(items: Sequence[T], size: int, key: str) -> list[T]:
    """`size` of `items` (all of them when there are no more), in their order, drawn from `key`: the
    same subset at every evaluation of a run, so its curve compares like with like."""
    if len(items) <= size:
        return list(items)
    return [items[i] for i in sorted(random.Random(key).sample(range(len(items)), size))]


def take_batch(position: DataPosition, n_rows: int, seed: int, size: int) -> tuple[list[int], DataPosition]:
    """The next `size` row indices from `position`, and the position after them."""
    epoch, index = position.epoch, position.index
    order = position.permutation or epoch_permutation(n_rows, seed, epoch)
    rows = []
    while len(rows) < size:
        if index == n_rows:
            epoch, index = epoch + 1, 0
            order = epoch_permutation(n_rows, seed, epoch)
        rows.append(order[index])
        index += 1
    return rows, DataPosition(epoch, index, list(order))


def spec_for(prompt: Prompt, seed: int) -> RolloutSpec:
    """The rollout engine's input for one run of `prompt` (training, eval and the diagnostic)."""
    return RolloutSpec(sample_index=prompt.row_index, messages=prompt.messages, tools=prompt.tools,
                       item=prompt.item, seed=seed)


def rollout_seed(*parts: Any) -> int:
    """A 48-bit seed from the parts (the engine multiplies it by 1000 for per-turn generators)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:6], "big")


def total_steps_for(n_train: int, batch_size: int, n_epochs: int) -> int:
    """Steps to see every row `n_epochs` times; a batch may run on into the next epoch."""
    return math.ceil(n_epochs * n_train / batch_size) if n_train else 0
