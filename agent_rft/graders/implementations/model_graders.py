"""`score_model` and `label_model`: a judge model reads the templated `input` messages.

As OpenAI documents them: score_model's judge answers `{"steps": [...], "result": <number>}`
and the reward is `result` clamped to `range` (default [0, 1]); label_model's judge answers
one of `labels` and the reward is 1 when it is among `passing_labels`, else 0.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from agent_rft.retry import excerpt
from agent_rft.graders.core import GradeResult, GraderContext, GraderError, Sample, implements
from agent_rft.graders.judges import JudgeReply, ask_judge
from agent_rft.graders.schemas import LabelModelGrader, ScoreModelGrader
from agent_rft.graders.templating import render

DEFAULT_RANGE = (0.0, 1.0)
_FENCED = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)

SCORE_INSTRUCTIONS = (
    "Reply with only a JSON object of this form, and nothing else:\n"
    '{{"steps": [{{"description": "<what you checked>", "conclusion": "<what you found>"}}], '
    '"result": <your score, a number from {low:g} to {high:g}>}}'
)
LABEL_INSTRUCTIONS = (
    "Reply with only a JSON object of this form, and nothing else:\n"
    '{{"result": "<your label>"}}\nwhere the label is exactly one of: {labels}.'
)


# --- the judge's prompt ----------------------------------------------------------------------


def _render_part(part: Any, sample: Sample, item: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI grader content part as a chat-completions content part, templates filled."""
    if isinstance(part, str):
        return {"type": "text", "text": render(part, sample, item)}
    if not isinstance(part, dict):
        raise GraderError("other_error", f"unsupported message content: {excerpt(json.dumps(part, default=str))}")
    kind = part.get("type")
    if isinstance(part.get("text"), str) and kind in (None, "input_text", "output_text", "text"):
        return {"type": "text", "text": render(part["text"], sample, item)}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        image = {"url": render(part["image_url"], sample, item)}
        if part.get("detail"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_audio" and isinstance(part.get("input_audio"), dict):
        return {"type": "input_audio", "input_audio": part["input_audio"]}
    raise GraderError("other_error", f"unsupported message content part of type {kind!r}")


def _render_content(content: Any, sample: Sample, item: dict[str, Any]) -> str | list[dict[str, Any]]:
    parts = [_render_part(p, sample, item) for p in (content if isinstance(content, list) else [content])]
    if all(p["type"] == "text" for p in parts):  # plain text is what every chat server accepts
        return "\n".join(p["text"] for p in parts)
    return parts


def judge_messages(messages: list[Any], instructions: str, sample: Sample, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's messages, rendered, with the answer-format instructions in the system prompt."""
    rendered = [
        # `developer` is OpenAI's newer name for `system`; open-model servers know only `system`.
        {"role": "system" if m.role == "developer" else m.role, "content": _render_content(m.content, sample, item)}
        for m in messages
    ]
    first = rendered[0]
    if first["role"] == "system" and isinstance(first["content"], str):
        first["content"] = f"{first['content']}\n\n{instructions}"
    else:
        rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def sampling_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's grader sampling_params as chat-completions fields; others pass through as given."""
    out = {k: v for k, v in (params or {}).items() if v is not None}
    if "max_completions_tokens" in out:  # the grader field's spelling differs from the chat API's
        out.setdefault("max_completion_tokens", out.pop("max_completions_tokens"))
    return out


# --- the judge's answer ----------------------------------------------------------------------


def _json_objects(text: str) -> list[dict[str, Any]]:
    """JSON objects in a reply: the whole reply, fenced blocks, then any `{...}` inside text."""
    candidates = [text.strip(), *(m.strip() for m in _FENCED.findall(text))]
    found = []
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _parse_failure(reply: JudgeReply, what: str) -> GraderError:
    cut = " (the judge hit its token limit)" if reply.finish_reason == "length" else ""
    return GraderError("model_grader_parse_error", f"{what}{cut}; judge replied: {excerpt(reply.content) or '(empty)'}")


def parse_score(reply: JudgeReply) -> tuple[float, list[Any]]:
    for obj in _json_objects(reply.content):
        for key in ("result", "score"):
            if key in obj and (score := _number(obj[key])) is not None:
                steps = obj.get("steps")
                return score, steps if isinstance(steps, list) else []
    if (score := _number(reply.content.strip())) is not None:  # a bare number is unambiguous
        return score, []
    raise _parse_failure(reply, 'no numeric "result" in the judge\'s reply')


def parse_label(reply: JudgeReply, labels: list[str]) -> str:
    for obj in _json_objects(reply.content):
        for key in ("result", "label"):
            if isinstance(obj.get(key), str):
                return _known_label(obj[key], labels, reply)
    text = reply.content.strip().strip("\"'`.").strip()
    if text:
        return _known_label(text, labels, reply, search=True)
    raise _parse_failure(reply, "the judge gave no label")


def _known_label(answer: str, labels: list[str], reply: JudgeReply, *, search: bool = False) -> str:
    if answer in labels:
        return answer
    folded = [label for label in labels if label.casefold() == answer.strip().casefold()]
    if len(folded) == 1:
        return folded[0]
    if search:  # plain prose: accept it when exactly one label appears in it as a whole word
        mentioned = [label for label in labels if re.search(rf"(?<!\w){re.escape(label)}(?!\w)", answer, re.IGNORECASE)]
        if len(mentioned) == 1:
            return mentioned[0]
    raise _parse_failure(reply, f"label {excerpt(answer)!r} is not one of {labels}")


# --- graders ---------------------------------------------------------------------------------


def _check_refusal(reply: JudgeReply) -> None:
    if reply.refusal or reply.finish_reason == "content_filter":
        reason = reply.refusal or "the judge's answer was stopped by its content filter"
        raise GraderError("model_grader_refusal_error", f"judge refused: {excerpt(reason)}")


def _record_usage(result: GradeResult, reply: JudgeReply) -> None:
    result.sampled_model_name = reply.model
    if reply.usage:
        total = reply.usage.get("total_tokens", reply.usage.get("prompt_tokens", 0) + reply.usage.get("completion_tokens", 0))
        result.token_usage = total
        result.model_token_usage = {reply.model: {**reply.usage, "total_tokens": total}}


# The most text a judge is shown (about 100k tokens). A longer rendered prompt would have to be
# cut, and a judge that sees part of the sample cannot grade it: truncated_observation_error.
MAX_JUDGE_INPUT_CHARS = 400_000


def _check_observation_size(messages: list[dict[str, Any]]) -> None:
    size = sum(len(m["content"]) if isinstance(m["content"], str) else len(str(m["content"])) for m in messages)
    if size > MAX_JUDGE_INPUT_CHARS:
        raise GraderError(
            "truncated_observation_error",
            f"the judge prompt is {size} characters after templating, over the {MAX_JUDGE_INPUT_CHARS}-character "
            "limit; the judge would see only part of the sample",
        )


async def _judge_and_score(config: Any, instructions: str, sample: Sample, item: dict[str, Any], ctx: GraderContext, score,  # noqa: ANN001
                           trace_id: str | None = None) -> GradeResult:
    """Ask the judge, then `score(reply, result)`; failures after the answer keep its token usage."""
    messages = judge_messages(config.input, instructions, sample, item)
    _check_observation_size(messages)
    params = sampling_params(getattr(config, "sampling_params", None))
    reply = await ask_judge(config.model, messages, params, ctx, trace_id)
    result = GradeResult(name=config.name, type=config.type, reward=0.0)
    _record_usage(result, reply)
    try:
        _check_refusal(reply)
        score(reply, result)
    except GraderError as error:
        result.flag(error)
    return result


@implements("score_model")
async def grade_score_model(
    config: ScoreModelGrader, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    low, high = config.range or DEFAULT_RANGE

    def score(reply: JudgeReply, result: GradeResult) -> None:
        raw, steps = parse_score(reply)
        result.reward = min(max(raw, low), high)
        result.scores = {"result": raw, "steps": steps}
        if config.pass_threshold is not None:
            result.passed = result.reward >= config.pass_threshold

    return await _judge_and_score(config, SCORE_INSTRUCTIONS.format(low=low, high=high), sample, item, ctx, score,
                                  trace_id)


@implements("label_model")
async def grade_label_model(
    config: LabelModelGrader, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    instructions = LABEL_INSTRUCTIONS.format(labels=", ".join(json.dumps(label) for label in config.labels))

    def score(reply: JudgeReply, result: GradeResult) -> None:
        label = parse_label(reply, config.labels)
        result.passed = label in config.passing_labels
        result.reward = 1.0 if result.passed else 0.0
        result.scores = {"label": label}

    return await _judge_and_score(config, instructions, sample, item, ctx, score, trace_id)
