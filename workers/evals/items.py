"""What an eval run does to each item, without the control plane: the items of its data source,
the messages a model answers (a template with `{{item.*}}` holes, or a reference into the item),
the engine settings from `sampling_params` and `x_open_model`, grading by every testing criterion,
and the output item the control plane stores (OpenAI's `sample` and `results`, plus the trajectory).

Seeds: sample k of item i uses rollout_seed(seed, "eval", i, k), so a worker that takes a run
over re-runs a missing item exactly as the first worker would have."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from agent_rft.graders.batch import BatchGrade, grade_many
from agent_rft.graders.core import GraderContext, Sample
from agent_rft.graders.schemas import split_pass_threshold
from agent_rft.graders.templating import content_text, render, resolve
from workers.engine.grading import load_grader
from workers.engine.rollout import OPENAI_FINISH_REASONS, EngineConfig, RolloutRecord, RolloutSpec
from workers.engine.toolcalls import ToolSchema
from workers.training.data import job_tool_schemas, rollout_seed

PASS_THRESHOLD = 0.5  # a score at or above this passes when the criterion says nothing else


@dataclass
class Item:
    index: int
    item: dict[str, Any]
    sample: dict[str, Any] | None = None  # given (a jsonl run)


@dataclass
class Graded:
    """One sample of one item: its trace id, what graders saw, and every criterion's grade."""

    item: Item
    sample_index: int
    trace_id: str
    sample: Sample
    grades: list[BatchGrade]
    record: RolloutRecord | None = None
    error: str | None = None  # the item could not be turned into a model input


def input_error(item: Item, sample_index: int, problem: str) -> Graded:
    """An item that cannot be run: it does not fit the item schema, or its input messages cannot be
    built from the data source (a field the template names is missing)."""
    return Graded(item, sample_index, f"trace_{uuid.uuid4().hex}", Sample(), [], error=problem)


class BadSource(ValueError):
    """A data-source file line that is not a JSON object: the run fails, naming the line."""


def rows_of(text: str) -> list[dict[str, Any]]:
    """A JSONL file's rows; BadSource names the first line that is not a JSON object."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise BadSource(f"line {number} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise BadSource(f"line {number} is not a JSON object")
        rows.append(row)
    return rows


def items_of(rows: list[dict[str, Any]]) -> list[Item]:
    """A source's rows as items: `{"item": {...}, "sample": {...}}` as OpenAI writes them, or a
    row without `item` taken as the item itself (so a job's JSONL file runs as it is)."""
    items = []
    for index, row in enumerate(rows):
        if isinstance(row.get("item"), dict):
            items.append(Item(index, row["item"], row.get("sample") if isinstance(row.get("sample"), dict) else None))
        else:
            items.append(Item(index, row))
    return items


def item_problem(item: Item, schema: dict[str, Any], *, needs_sample: bool) -> str | None:
    """Why `item` cannot be run (it does not fit the eval's item schema; a jsonl row without its
    sample), or None."""
    error = best_match(validator_for(schema)(schema).iter_errors(item.item)) if schema else None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        return f"the item does not match the eval's item_schema{f' at {where}' if where else ''}: {error.message}"
    if needs_sample and item.sample is None:
        return "a jsonl run grades given samples: this row has no 'sample'"
    return None


def input_messages(data_source: dict[str, Any], item: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation the model answers; ValueError when the item does not fit the template."""
    spec = data_source["input_messages"]
    if spec["type"] == "template":
        empty = Sample()
        return [{"role": "system" if m["role"] == "developer" else m["role"],
                 "content": render(content_text(m["content"]), empty, item)} for m in spec["template"]]
    value = resolve(spec["item_reference"], Sample(), item)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise ValueError(f"{spec['item_reference']} is not a list of messages")
    return value


def tool_schemas(data_source: dict[str, Any], item: dict[str, Any]) -> list[ToolSchema]:
    """The item's own `tools` (a fine-tuning row's), else `sampling_params.tools`, else the schemas
    given with the tool endpoints."""
    declared = item.get("tools") if isinstance(item.get("tools"), list) else \
        (data_source.get("sampling_params") or {}).get("tools")
    if declared:
        return [ToolSchema.from_openai(t if "function" in t else {"type": "function", "function": {
            k: v for k, v in t.items() if k != "type"}}) for t in declared]
    return job_tool_schemas((data_source.get("x_open_model") or {}).get("tools") or [])


def engine_config(data_source: dict[str, Any]) -> EngineConfig:
    from app.responses.convert import chat_response_format

    params, agent = data_source.get("sampling_params") or {}, data_source.get("x_open_model") or {}
    per_turn = params.get("max_completion_tokens") or 256
    steps = agent.get("max_episode_steps", 10) if agent.get("tools") else 0  # no endpoints: one turn, calls as text
    return EngineConfig(
        max_episode_steps=steps, max_tokens_per_turn=per_turn,
        max_tokens_per_rollout=agent.get("max_tokens_per_rollout") or per_turn * (steps + 1),
        temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
        rollout_timeout_s=agent.get("rollout_timeout"),
        response_format=params.get("response_format") or chat_response_format((params.get("text") or {}).get("format")))


def spec_for_item(data_source: dict[str, Any], item: Item, sample_index: int) -> RolloutSpec:
    seed = (data_source.get("sampling_params") or {}).get("seed") or 0
    return RolloutSpec(sample_index=item.index, messages=input_messages(data_source, item.item),
                       tools=tool_schemas(data_source, item.item), item=item.item,
                       seed=rollout_seed(seed, "eval", item.index, sample_index))


def criteria_graders(criteria: list[dict[str, Any]]) -> list[tuple[Any, float | None]]:
    """Each criterion's grader config and the pass_threshold it carries beside a grader type that has none."""
    return [(load_grader(body), threshold) for body, threshold in map(split_pass_threshold, criteria)]


async def grade_samples(graders: list[tuple[Any, float | None]], ctx: GraderContext,
                        samples: list[tuple[Item, int, str, Sample, RolloutRecord | None]]) -> list[Graded]:
    """Every sample graded by every criterion, each grader call with its item's trace id."""
    jobs = [(sample, item.item, trace_id) for item, _, trace_id, sample, _ in samples]
    per_criterion = [await grade_many(grader, jobs, ctx) for grader, _ in graders] if jobs else []
    return [Graded(item, k, trace_id, sample, [grades[i] for grades in per_criterion], record)
            for i, (item, k, trace_id, sample, record) in enumerate(samples)]


def given_sample(item: Item) -> tuple[Item, int, str, Sample, None]:
    """A jsonl row's sample as graders see it."""
    return item, 0, f"trace_{uuid.uuid4().hex}", Sample.from_model_sample(_sample_text(item.sample or {})), None


def _sample_text(sample: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's sample shape (`output_text`, or `choices[0].message.content`, or `output`) for graders."""
    if "output_text" in sample:
        return sample
    choices = sample.get("choices") or []
    text = (choices[0].get("message") or {}).get("content") if choices and isinstance(choices[0], dict) else None
    if text is None and isinstance(sample.get("output"), list) and sample["output"]:
        text = content_text((sample["output"][-1] or {}).get("content"))
    return {**sample, "output_text": text or ""}


def _result(grade: BatchGrade, criterion: dict[str, Any], threshold: float | None) -> dict[str, Any]:
    passed = grade.passed if grade.passed is not None else grade.reward >= (
        threshold if threshold is not None else PASS_THRESHOLD)
    result = {"name": criterion.get("name", criterion.get("type")), "type": criterion.get("type"),
              "score": None if grade.failed else grade.reward, "passed": bool(passed and not grade.failed),
              "sample": None}
    if grade.failed:
        result["error"] = {"flags": grade.errors, "details": grade.details}
    return result


def output_item(graded: Graded, criteria: list[dict[str, Any]], thresholds: list[float | None],
                data_source: dict[str, Any], model: str) -> dict[str, Any]:
    """The output item the control plane stores (app/evals/worker_schemas.OutputItemPush)."""
    if graded.error is not None:
        results = [{"name": c.get("name"), "type": c.get("type"), "score": None, "passed": False, "sample": None,
                    "error": {"flags": ["invalid_item"], "details": graded.error}} for c in criteria]
    else:
        results = [_result(grade, criterion, threshold) for grade, criterion, threshold in
                   zip(graded.grades, criteria, thresholds)]
    status = "error" if any("error" in r for r in results) else "pass" if all(r["passed"] for r in results) else "fail"
    record = graded.record
    return {"item_index": graded.item.index, "sample_index": graded.sample_index, "trace_id": graded.trace_id,
            "status": status, "datasource_item": graded.item.item, "results": results,
            "sample": _openai_sample(graded, record, data_source, model),
            "trajectory": record.summary() if record is not None else None}


def _openai_sample(graded: Graded, record: RolloutRecord | None, data_source: dict[str, Any],
                   model: str) -> dict[str, Any]:
    if graded.error is not None:
        return {"input": [], "output": [], "finish_reason": "error", "model": model, "usage": {},
                "error": {"code": "invalid_item", "message": graded.error}}
    if record is None:
        given = graded.item.sample or {}
        return {**given, "output": given.get("output") or [{"role": "assistant", "content": graded.sample.output_text}],
                "usage": given.get("usage") or {}, "error": None}
    params = data_source.get("sampling_params") or {}
    first_reply = next((i for i, m in enumerate(record.messages) if m.get("role") == "assistant"), len(record.messages))
    return {
        "input": [{"role": m["role"], "content": content_text(m.get("content"))} for m in record.messages[:first_reply]],
        "output": [{"role": "assistant", "content": record.final_answer}],
        "finish_reason": OPENAI_FINISH_REASONS.get(record.finish_reason, "stop"), "model": model,
        "usage": {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                  "total_tokens": record.prompt_tokens + record.completion_tokens, "cached_tokens": 0,
                  "x_invocations": record.turns, "x_tool_output_tokens": record.tool_output_tokens},
        "error": None, "seed": (params.get("seed") or 0), "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0), "max_completion_tokens": params.get("max_completion_tokens") or 256,
    }
