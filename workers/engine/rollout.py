"""The rollout engine: many multi-turn episodes at once, each calling the customer's tools
over HTTP, generation batched across every rollout that is waiting for the model.

Token-in/token-out: a rollout's token ids are the prompt's, then exactly what the model
sampled, then the rendered tool results; the loss mask is 1 only on sampled tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workers import spans
from workers.engine.constraints import AnswerFormat
from workers.engine.sampler import CacheHandle, GenerationOutput, GenerationRequest, Sampler, SamplingSession
from workers.engine.prompting import (
    ChatFormatter, assistant_message, budget_spent_message, feedback_message, tool_result_message,
)
from workers.engine.toolcalls import ToolSchema
from workers.engine.tools_client import ToolResult

FINISH_REASONS = ("answered", "tool_budget", "token_cap", "truncated", "tool_failure", "parse_error", "deadline")
# What a grader's `sample.choices[0].finish_reason` says for each, in OpenAI's words: the model stopped
# on its own, was cut off, or its last turn asked for tool calls.
OPENAI_FINISH_REASONS = {"answered": "stop", "parse_error": "stop", "token_cap": "length", "truncated": "length",
                         "tool_budget": "tool_calls", "tool_failure": "tool_calls", "deadline": "tool_calls"}


@dataclass
class EngineConfig:
    max_episode_steps: int = 10  # tool calls per rollout
    max_tokens_per_turn: int = 256
    max_tokens_per_rollout: int = 2048  # sampled tokens, all turns together
    max_context_tokens: int | None = None  # default: the sampler's (the model's, or the vLLM fleet's)
    temperature: float = 1.0
    top_p: float = 1.0
    # Seconds a rollout may take in all (x_open_model.rollout_timeout); None: no limit.
    rollout_timeout_s: float | None = None
    max_batch_size: int = 32
    max_consecutive_parse_errors: int = 3  # then the rollout ends as parse_error
    # How long a batch waits for rollouts still busy with tool calls before it starts without them.
    # Tool results come back staggered; without a short wait, one slow-ish batch becomes several small ones.
    batch_wait_s: float = 0.25
    # Memory the rollouts' attention caches may hold between turns (kept, a turn prefills only its
    # new tokens); over it, a turn re-prefills its whole context. 0: never keep.
    kv_cache_mb: float = 512.0
    # Sample on weights prepared for the run (models.sampling_weights): LoRA merged, one matmul per
    # layer instead of two paths with float32 casts; bf16 linear layers packed for oneDNN on a CPU.
    # The trainer recomputes its log-probs unmerged, so the PPO ratio is against the policy it
    # trains; the rounding of the merge shows in train.logprob_mismatch.
    sampling_weights: bool = True
    # The job's `response_format` (json_schema or json_object): each turn is a free tool call or the
    # final answer as JSON that fits it (workers/engine/constraints.AnswerFormat). None: free text.
    response_format: dict[str, Any] | None = None


@dataclass
class RolloutSpec:
    sample_index: int
    messages: list[dict[str, Any]]
    tools: list[ToolSchema]
    item: dict[str, Any]
    seed: int


@dataclass
class ToolCallRecord:
    call_id: str
    name: str
    arguments: str
    status: str
    status_code: int | None
    latency_s: float
    bytes: int
    error: str | None
    truncated: bool = False
    turn: int = 0  # the assistant turn that made the call; calls of one turn run concurrently
    cached: bool = False  # answered from the tool-result cache (no request reached the endpoint)
    throttled: int = 0  # answers that asked to wait (429/503 with Retry-After), waited out
    throttle_wait_s: float = 0.0  # seconds the call waited for them
    concurrency: int | None = None  # the tool's concurrency limit when the call ended (AIMD)


@dataclass
class RolloutRecord:
    trace_id: str
    sample_index: int
    messages: list[dict[str, Any]]
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_output_tokens: int = 0
    turns: int = 0
    policy_versions: list[int] = field(default_factory=list)  # of the policy that sampled each turn, in order
    parse_errors: int = 0
    wall_time_s: float = 0.0
    finish_reason: str = "answered"
    final_answer: str = ""
    output_json: Any = None  # the final answer parsed, when the job asks for JSON answers
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    # Under a response_format: for each sampled token (by its index in token_ids), the tokens the
    # constraint allowed there, packed (constraints.AnswerFormat.masks): the trainer's log-probs are
    # taken under the same masks, as the sampler's were.
    allowed: dict[int, Any] = field(default_factory=dict)

    @property
    def tool_failure(self) -> bool:
        return self.finish_reason == "tool_failure"

    def sampled_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each turn's sampled tokens in token_ids: a turn's context is [0, start)."""
        spans, start = [], None
        for i, flag in enumerate([*self.loss_mask, 0]):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                spans.append((start, i))
                start = None
        return spans

    def calls_by_tool(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for call in self.tool_calls:
            counts[call.name] = counts.get(call.name, 0) + 1
        return counts

    def grader_sample(self) -> dict[str, Any]:
        """What graders see (`{{sample.*}}`, endpoint graders' `sample`)."""
        output_tools = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.tool_calls
        ]
        return {
            "output_text": self.final_answer,
            **({"output_json": self.output_json} if self.output_json is not None else {}),
            "output_tools": output_tools,
            "choices": [{"index": 0, "finish_reason": OPENAI_FINISH_REASONS.get(self.finish_reason, "stop"),
                         "x_finish_reason": self.finish_reason,
                         "message": {"role": "assistant", "content": self.final_answer}}],
            "trajectory": self.messages,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "tool_output_tokens": self.tool_output_tokens},
        }

    def summary(self) -> dict[str, Any]:
        """The record without the token arrays, for storage and display."""
        data = asdict(replace(self, token_ids=[], logprobs=[], loss_mask=[], allowed={}))
        for key in ("token_ids", "logprobs", "loss_mask", "allowed"):
            data.pop(key)
        return data


class RolloutEngine:
    """Runs rollouts: the episodes' logic here, generation through `sampler` (workers/engine/sampler.py);
    by default the in-process engine on `model`."""

    def __init__(self, model: Any, tokenizer: Any, formatter: ChatFormatter, tool_client: Any,
                 config: EngineConfig | None = None, sampler: Sampler | None = None) -> None:
        self.model, self.tokenizer, self.formatter, self.tools = model, tokenizer, formatter, tool_client
        self.config = config or EngineConfig()
        self.sampler = sampler or self._in_process_sampler()
        self.answer_format = AnswerFormat.of(self.config.response_format, tokenizer, formatter.parser)
        self.stop_token_ids = frozenset(formatter.stop_token_ids())
        self.stop_strings = tuple(formatter.parser.stop_strings)
        # Of the last run: time inside the model, and of it prefill_s and decode_s; tokens fed by
        # prefills, requests joined by each prefill, most rows decoding at once.
        self.generation_s = 0.0
        self.generation_timings: dict[str, float] = {}
        self.prefill_tokens = 0
        self.prefill_rows: list[int] = []
        self.largest_batch = 0

    def _in_process_sampler(self) -> Sampler:
        from workers.engine.inprocess_sampler import InProcessSampler  # torch: only where the model is here

        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return InProcessSampler(self.model, pad_token_id=pad, config=self.config, decode=self.formatter.decode)

    @property
    def max_context(self) -> int:
        """Tokens a rollout may span: the job's limit within the sampler's window (a vLLM fleet may
        serve a shorter one than the model's config), so that no request asks for more."""
        limits = [limit for limit in (self.config.max_context_tokens, self.sampler.max_context) if limit]
        if not limits and self.model is not None:
            limits = [getattr(self.model.config, "max_position_embeddings", 8192)]
        return min(limits) if limits else 8192

    async def run(self, specs: list[RolloutSpec]) -> list[RolloutRecord]:
        session: SamplingSession | None = None
        try:
            async with self.sampler.session() as session:
                return list(await asyncio.gather(*(self._rollout(spec, session) for spec in specs)))
        finally:
            if session is not None:  # read once the session is over, so the counts are final
                self._keep_counts(session)

    def _keep_counts(self, session: SamplingSession) -> None:
        self.generation_s, self.generation_timings = session.generation_s, dict(session.timings)
        self.prefill_tokens, self.prefill_rows = session.prefill_tokens, session.prefill_rows
        self.largest_batch = session.largest_batch

    async def _rollout(self, spec: RolloutSpec, session: SamplingSession) -> RolloutRecord:
        started = time.perf_counter()
        record = RolloutRecord(trace_id=f"trace_{uuid.uuid4().hex}", sample_index=spec.sample_index,
                               messages=list(spec.messages))
        state = _Episode(self, spec, record, session)
        session.started()
        try:
            with spans.rollout_span(record.trace_id, spec.sample_index):
                await state.play()
        finally:
            session.release(state.kv)
            session.finished()
            record.wall_time_s = time.perf_counter() - started
        return record


class _Episode:
    """One rollout's turn loop."""

    def __init__(self, engine: RolloutEngine, spec: RolloutSpec, record: RolloutRecord,
                 session: SamplingSession) -> None:
        self.engine, self.spec, self.record, self.session = engine, spec, record, session
        self.cfg = engine.config
        self.fmt = engine.formatter
        self.kv: CacheHandle | None = None  # the session's cache of this rollout's context from its last turn
        timeout = self.cfg.rollout_timeout_s
        self.deadline = asyncio.get_running_loop().time() + timeout if timeout else None

    def _append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.record.token_ids += ids
        self.record.loss_mask += [1 if sampled else 0] * len(ids)
        self.record.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def _finish(self, reason: str) -> None:
        self.record.finish_reason = reason

    async def play(self) -> None:
        record = self.record
        self._append(self.fmt.prompt_ids(self.spec.messages, self.spec.tools), sampled=False)
        record.prompt_tokens = len(record.token_ids)
        consecutive_parse_errors = 0
        while True:
            if self._past_deadline():
                return self._finish("deadline")
            output = await self._next_turn()
            if output is None:
                return
            text = self.fmt.assistant_text(output.token_ids)
            record.messages.append(assistant_message(text))
            record.turns += 1
            self._append(self.fmt.close_turn_ids(output.token_ids), sampled=False)
            parsed = self.fmt.parser.parse(text, self.spec.tools, rng=random.Random(self.spec.seed * 1000 + record.turns))
            record.parse_errors += len(parsed.issues)
            if output.finish != "stop" and not parsed.calls:
                # Cut by the per-turn or per-rollout cap before it finished: not a real answer.
                record.final_answer = parsed.content
                return self._finish("token_cap")
            if not parsed.calls and not parsed.issues:
                record.final_answer = parsed.content
                record.output_json = self._answer_json(parsed.content)
                return self._finish("answered")
            consecutive_parse_errors = consecutive_parse_errors + 1 if parsed.issues and not parsed.calls else 0
            if consecutive_parse_errors >= self.cfg.max_consecutive_parse_errors:
                return self._finish("parse_error")
            if self._past_deadline():  # more tool calls would run past it: the rollout stops as it stands
                record.final_answer = parsed.content
                return self._finish("deadline")
            used = len(record.tool_calls)
            if parsed.calls and used >= self.cfg.max_episode_steps:
                record.final_answer = parsed.content
                return self._finish("tool_budget")
            calls = parsed.calls[: self.cfg.max_episode_steps - used]
            try:
                async with asyncio.timeout_at(self.deadline):  # None: no limit
                    results = await asyncio.gather(*(self._call_tool(call) for call in calls))
            except TimeoutError:  # a tool still running at the deadline: its call is cancelled, a failure
                return self._finish("tool_failure")
            if any(r.status == "failed" for r in results):
                return self._finish("tool_failure")
            new_messages = [tool_result_message(call, result.output) for call, result in zip(calls, results)]
            feedback = self._feedback(parsed, dropped=len(parsed.calls) - len(calls))
            if feedback:
                new_messages.append(feedback_message(feedback))
            if not self._extend_with(record.messages, new_messages):
                return
            record.messages += new_messages

    async def _next_turn(self) -> GenerationOutput | None:
        record = self.record
        room = self.engine.max_context - len(record.token_ids)
        budget = self.cfg.max_tokens_per_rollout - record.completion_tokens
        if budget <= 0:
            self._finish("token_cap")
            return None
        if room <= 0:
            self._finish("truncated")
            return None
        request = GenerationRequest(context_ids=list(record.token_ids),
                                    max_new_tokens=min(self.cfg.max_tokens_per_turn, budget, room),
                                    seed=self.spec.seed * 1000 + record.turns,
                                    stop_token_ids=self.engine.stop_token_ids,
                                    stop_strings=self.engine.stop_strings,
                                    prefix=self.kv, keep_cache=self.session.keeps_caches,
                                    affinity=record.trace_id, constraint=self._constraint())
        self.kv = None  # handed to the session (a batching one accounts for it)
        output = await self.session.generate(request)
        self.kv, output.cache = output.cache, None
        if request.constraint is not None:
            self._keep_masks(len(record.token_ids), output.token_ids)
        self._append(output.token_ids, sampled=True, logprobs=output.logprobs)
        if output.policy_version is not None:
            record.policy_versions.append(output.policy_version)
        record.completion_tokens += len(output.token_ids)
        if output.finish != "stop" and len(record.token_ids) >= self.engine.max_context:
            self._finish("truncated")
            return None
        return output

    def _constraint(self) -> Any:
        answer_format = self.engine.answer_format
        return answer_format.constraint(tools=bool(self.spec.tools)) if answer_format is not None else None

    def _keep_masks(self, start: int, token_ids: list[int]) -> None:
        masks = self.engine.answer_format.masks(token_ids, tools=bool(self.spec.tools))
        if masks is not None:  # else (a sampler that did not follow the grammar) the turn is scored unmasked
            self.record.allowed.update(zip(range(start, start + len(masks)), masks))

    def _answer_json(self, answer: str) -> Any:
        """The final answer as the JSON value it is, when the job asks for JSON answers."""
        if self.engine.answer_format is None:
            return None
        try:
            return json.loads(answer)
        except ValueError:
            return None

    def _feedback(self, parsed: Any, *, dropped: int) -> str:
        parts = []
        if parsed.issues:
            parts.append(parsed.error_feedback())
        used = len(self.record.tool_calls)
        if dropped:
            parts.append(f"{dropped} tool call(s) were not run: the budget of {self.cfg.max_episode_steps} tool calls is spent.")
        if used >= self.cfg.max_episode_steps:
            parts.append(budget_spent_message(self.spec.messages))
        return "\n".join(parts)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline

    async def _call_tool(self, call: Any) -> Any:
        def record_cancelled(result: ToolResult) -> None:
            # The rollout's deadline: the call is recorded as far as it got (its throttled answers and waits).
            error = f"cancelled: the rollout's deadline of {self.cfg.rollout_timeout_s:g} s passed"
            self._record_call(call, replace(result, error=error))

        with spans.tool_call_span(call.name) as span:
            result = await self.engine.tools.call(trace_id=self.record.trace_id, call_id=call.call_id, name=call.name,
                                                  arguments_json=call.arguments_json, item=self.spec.item,
                                                  on_cancel=record_cancelled)
            spans.end_tool_call(span, result.status, result.error)
        self._record_call(call, result)
        return result

    def _record_call(self, call: Any, result: ToolResult) -> None:
        self.record.tool_calls.append(ToolCallRecord(
            call_id=call.call_id, name=call.name, arguments=call.arguments_json, status=result.status,
            status_code=result.status_code, latency_s=result.latency_s, bytes=result.bytes, error=result.error,
            truncated=result.truncated, turn=self.record.turns, cached=result.cached, throttled=result.throttled,
            throttle_wait_s=result.throttle_wait_s, concurrency=result.concurrency,
        ))

    def _extend_with(self, before: list[dict[str, Any]], new_messages: list[dict[str, Any]]) -> bool:
        """Append the rendered tool results (and the next generation prompt): not trained on."""
        ids = self.fmt.continuation_ids(before, new_messages, self.spec.tools)
        if len(self.record.token_ids) + len(ids) >= self.engine.max_context:
            self._finish("truncated")
            return False
        self._append(ids, sampled=False)
        self.record.tool_output_tokens += len(ids)
        return True

