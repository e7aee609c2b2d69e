"""A LoRA adapter trained, in the test itself, to make SmolLM2-135M-Instruct call the search tool.

Whether the base model calls a tool when prompted depends on the CPU's kernels (on some CPUs its
greedy answer to a worked-example prompt is a call, on others prose). Tests that need rollouts
with tool calls on the real model train this adapter first, so the call is made on purpose: a few
steps of cross-entropy on one call push its probability far past any kernel's rounding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.engine.toolcalls import ToolSchema

MODEL = "SmolLM2-135M-Instruct"
SEARCH = ToolSchema("search", "Search the reports", {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]})
QUESTION = [{"role": "system", "content": "Search the reports before you answer."},
            {"role": "user", "content": "What was ACME's revenue in 2023?"}]
CALL = '<tool_call>' + json.dumps({"name": "search", "arguments": {"query": "ACME revenue 2023"}}) + '</tool_call>'


def train_tool_calling_adapter(folder: Path, *, steps: int = 10, seed: int = 0) -> Path:
    """Fit a rank-8 LoRA (q_proj, v_proj: what vLLM's --max-lora-rank 16 serves) so that the model
    answers QUESTION, with SEARCH rendered as in rollouts, with CALL; saves it (and the tokenizer)
    to `folder` and returns it. About 10 s on 2 CPU cores."""
    import torch
    from peft import LoraConfig, get_peft_model

    from workers.models.loading import load_model
    from workers.engine.prompting import ChatFormatter

    torch.manual_seed(seed)
    loaded = load_model(MODEL)
    formatter = ChatFormatter(loaded.tokenizer)
    prompt = formatter.prompt_ids(QUESTION, [SEARCH])
    target = formatter.encode(CALL)
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    model = get_peft_model(loaded.model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(folder))
    loaded.tokenizer.save_pretrained(str(folder))
    return folder


def merged_policy(adapter: Path) -> Any:
    """The base model with `adapter` merged in (float32, as the trainer recomputes log-probs)."""
    from peft import PeftModel

    from workers.models.loading import load_model

    return PeftModel.from_pretrained(load_model(MODEL).model, str(adapter)).merge_and_unload().eval()
