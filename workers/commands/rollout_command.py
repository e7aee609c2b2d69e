"""`agent-rft rollout`: run a model against real tools on a JSONL file and show what happened.

The same engine, parser and tool client as training, so a transcript here is what training sees.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from workers.training.data import ROW_KEYS
from workers.models.loading import load_model
from workers.models.registry import LoadedModel
from workers.engine.prompting import ChatFormatter
from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutRecord, RolloutSpec
from workers.engine.summary import format_table, summarize
from workers.engine.toolcalls import ToolSchema
from workers.engine.tools_client import ToolClient

class RolloutInputError(ValueError):
    pass


def read_tools(path: Path) -> list[dict[str, Any]]:
    try:
        tools = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RolloutInputError(f"{path}: cannot read tools: {exc}") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "name" in t and "server_url" in t for t in tools):
        raise RolloutInputError(f"{path}: expected a JSON list of {{name, server_url, headers?, parameters?}}")
    return tools


def read_specs(path: Path, tools: list[dict[str, Any]], *, n: int, limit: int | None, seed: int) -> list[RolloutSpec]:
    job_schemas = [ToolSchema(t["name"], t.get("description", ""), t.get("parameters") or {"type": "object"}) for t in tools]
    specs: list[RolloutSpec] = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if limit is not None and len({s.sample_index for s in specs}) >= limit:
                break
            try:
                row = json.loads(line)
                schemas = [ToolSchema.from_openai(t) for t in row["tools"]] if "tools" in row else job_schemas
                messages = row["messages"]
            except (ValueError, KeyError, TypeError) as exc:
                raise RolloutInputError(f"{path}: line {line_no}: {exc}") from exc
            item = {k: v for k, v in row.items() if k not in ROW_KEYS}
            sample = len({s.sample_index for s in specs})
            specs += [RolloutSpec(sample, messages, schemas, item, seed=seed + sample * 1000 + k) for k in range(n)]
    return specs


def format_transcript(index: int, record: RolloutRecord, *, width: int = 600) -> str:
    head = (f"=== rollout {index} · sample {record.sample_index} · {record.trace_id} · {record.finish_reason} · "
            f"{len(record.tool_calls)} tool calls · {record.completion_tokens} tokens · {record.wall_time_s:.2f} s")
    lines = [head]
    for message in record.messages:
        content = str(message.get("content", ""))
        if len(content) > width:
            content = content[:width] + f" … [{len(content) - width} more characters]"
        lines.append(f"[{message['role']}] {content}")
    for call in record.tool_calls:
        lines.append(f"  · {call.name}({call.arguments}) → {call.status} {call.status_code or ''} "
                     f"{call.latency_s * 1000:.0f} ms {call.bytes} B{' ' + call.error if call.error else ''}")
    return "\n".join(lines)


def load_policy(model: str, dtype: str | None = None) -> LoadedModel:
    """`model` as load_model names it, or a LoRA adapter directory (adapter_config.json, as a
    trained checkpoint is saved): its base model is loaded and the adapter applied. In float32
    the adapter is merged (generation at the base model's speed); in a 16-bit dtype it stays a
    separate float32 branch, because merging would round its small update away."""
    adapter_config = Path(model).expanduser() / "adapter_config.json"
    if not adapter_config.is_file():
        return load_model(model, dtype=dtype)
    import torch
    from peft import PeftModel

    try:
        base = json.loads(adapter_config.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RolloutInputError(f"{adapter_config}: cannot read base_model_name_or_path: {exc}") from exc
    loaded = load_model(base, dtype=dtype)
    try:
        adapted = PeftModel.from_pretrained(loaded.model, str(adapter_config.parent))
    except (OSError, ValueError) as exc:
        raise RolloutInputError(f"{adapter_config.parent}: cannot load the LoRA adapter: {exc}") from exc
    loaded.model = (adapted.merge_and_unload() if loaded.dtype == torch.float32 else adapted).eval()
    return loaded


async def run_rollouts(model: str | LoadedModel, specs: list[RolloutSpec], tools: list[dict[str, Any]],
                       config: EngineConfig, allowlist: list[str], dtype: str | None = None) -> list[RolloutRecord]:
    loaded = load_policy(model, dtype) if isinstance(model, str) else model
    async with ToolClient(tools, allowlist=allowlist) as client:
        engine = RolloutEngine(loaded.model, loaded.tokenizer, ChatFormatter(loaded.tokenizer), client, config)
        return await engine.run(specs)


def rollout_command(*, model: str, data: Path, tools_path: Path, n: int, limit: int | None, config: EngineConfig,
                    allowlist: list[str], seed: int, json_out: Path | None, echo: Any, dtype: str | None = None) -> int:
    tools = read_tools(tools_path)
    specs = read_specs(data, tools, n=n, limit=limit, seed=seed)
    if not specs:
        raise RolloutInputError(f"{data}: no rows")
    records = asyncio.run(run_rollouts(model, specs, tools, config, allowlist, dtype))
    for index, record in enumerate(records):
        echo(format_transcript(index, record) + "\n")
    summary = summarize(records)
    echo(format_table(summary))
    if json_out:
        json_out.write_text(json.dumps({"summary": summary, "rollouts": [r.summary() for r in records]}, indent=2))
        echo(f"\nwrote {json_out}")
    return 0
