"""Test policies for the rollout engine.

`ScriptedPolicy` is a stand-in for the model whose turns are written by the test: it puts all
probability on the next token of the scripted turn. The engine under test does everything
else for real: batching, parsing, HTTP tool calls, budgets, token bookkeeping."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import torch

SCRIPT_MARK = re.compile(r"SCRIPT=(\w+)")


class ScriptedPolicy(torch.nn.Module):
    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]], *, max_context: int = 8192) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.config = SimpleNamespace(max_position_embeddings=max_context)
        self._anchor = torch.nn.Parameter(torch.zeros(1))  # the engine asks for the device
        self.header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.vocab = len(tokenizer)
        self.forward_calls = 0

    def _turn_target(self, row: list[int]) -> tuple[list[int], int]:
        """The scripted ids of the turn being generated, and how many are already out."""
        script = self.scripts[SCRIPT_MARK.search(self.tokenizer.decode(row)).group(1)]
        starts = [i for i in range(len(row) - len(self.header) + 1) if row[i:i + len(self.header)] == self.header]
        turn_text = script[min(len(starts) - 1, len(script) - 1)] + "<|im_end|>"
        target = self.tokenizer.encode(turn_text, add_special_tokens=False)
        return target, len(row) - starts[-1] - len(self.header)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **_):  # noqa: ANN001, ANN201
        # The "keys" of its cache are the token ids themselves, so the engine's cache handling (rows
        # leaving, rows joining, caches kept across turns) is real: each row's context is read back
        # from the cache columns its attention mask uses.
        from transformers import DynamicCache

        self.forward_calls += 1
        cache = cache if cache is not None else DynamicCache()
        as_keys = input_ids.float()[:, None, :, None]
        keys, _ = cache.update(as_keys, as_keys, 0)
        logits = torch.full((len(input_ids), 1, self.vocab), -1e4)
        for i, (row_keys, mask) in enumerate(zip(keys[:, 0, :, 0], attention_mask)):
            target, done = self._turn_target(row_keys[mask.bool()].long().tolist())
            logits[i, 0, target[done] if done < len(target) else self.tokenizer.eos_token_id] = 1e4
        return SimpleNamespace(logits=logits, cache=cache)
