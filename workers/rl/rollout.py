"""The rollout engine: many multi-turn episodes at once, each calling the customer's tools
over HTTP, generation batched across every rollout that is waiting for the model.

Token-in/token-out: a rollout's token ids are the prompt's, then exactly what the model
sampled, then the rendered tool results; the loss mask is 1 only on sampled tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workers.rl.generation import DecodeBatch, GenerationOutput, GenerationRequest, KVPrefix
from workers.rl.models import release_freed_memory, sampling_weights
from workers.rl.prompting import (
    ChatFormatter, assistant_message, budget_spent_message, feedback_message, tool_result_message,
)
from workers.rl.toolcalls import ToolSchema
from workers.rl.tools_client import ToolResult

FINISH_REASONS = ("answered", "tool_budget", "token_cap", "truncated", "tool_failure", "parse_error", "deadline")


@dataclass
class EngineConfig:
    max_episode_steps: int = 10  # tool calls per rollout
    max_tokens_per_turn: int = 256
    max_tokens_per_rollout: int = 2048  # sampled tokens, all turns together
    max_context_tokens: int | None = None  # default: the model's max_position_embeddings
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
    parse_errors: int = 0
    wall_time_s: float = 0.0
    finish_reason: str = "answered"
    final_answer: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

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
            "output_tools": output_tools,
            "choices": [{"index": 0, "finish_reason": self.finish_reason,
                         "message": {"role": "assistant", "content": self.final_answer}}],
            "trajectory": self.messages,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "tool_output_tokens": self.tool_output_tokens},
        }

    def summary(self) -> dict[str, Any]:
        """The record without the token arrays, for storage and display."""
        data = asdict(self)
        for key in ("token_ids", "logprobs", "loss_mask"):
            data.pop(key)
        return data


class _Batcher:
    """Continuous batching across every rollout of a run: one DecodeBatch on a generation thread;
    a rollout's request joins it at the next decode step, and its turn comes back the moment it is
    done (its tool calls start while other rows still decode). Each rollout's attention cache is
    kept across its tool calls within `kv_cache_mb`; over that, a turn re-prefills its context."""

    def __init__(self, model: Any, *, pad_token_id: int, config: EngineConfig, decode: Any) -> None:
        self.model, self.pad_token_id, self.config, self.decode = model, pad_token_id, config, decode
        self.pending: list[tuple[GenerationRequest, asyncio.Future[GenerationOutput]]] = []
        self.lock = threading.Lock()  # pending is filled in the event loop and taken by the generation thread
        self.wake = asyncio.Event()
        self.generation_s = 0.0  # time the generation thread was busy, for reporting
        self.timings: dict[str, float] = {}  # of that time: prefill_s and decode_s (DecodeBatch)
        self.prefill_tokens = 0  # tokens fed by prefills
        self.prefill_rows: list[int] = []  # requests joined by each prefill
        self.largest_batch = 0  # most rows decoding at once
        self.kept_bytes = 0  # held by the caches rollouts keep between turns (bounded by kv_cache_mb)
        self.live = 0  # rollouts not finished: each is either pending here or busy with tool calls
        self.closed = False

    @property
    def keeps_caches(self) -> bool:
        return self.config.kv_cache_mb > 0

    def started(self) -> None:
        self.live += 1

    def finished(self) -> None:
        self.live -= 1
        self.wake.set()  # the batch may have been waiting for this rollout

    def release(self, cache: KVPrefix | None) -> None:
        """A kept cache that will not be used again (its rollout ended, or it was handed back)."""
        if cache is not None:
            with self.lock:
                self.kept_bytes -= cache.nbytes

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        with self.lock:
            self.pending.append((request, future))
        self.wake.set()
        return await future

    def close(self) -> None:
        """The run is over: the generation thread stops at its next step and `run` returns."""
        self.closed = True
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed:
            await self.wake.wait()
            self.wake.clear()
            for _ in range(3):  # let rollouts that just got their tool results join this batch
                await asyncio.sleep(0)
            if not self.pending:
                continue
            await self._gather()  # the first prefill of a run takes every rollout (and shares prompts)
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self._generate, loop)
            finally:
                self.generation_s += time.perf_counter() - started
            if self.pending:
                self.wake.set()

    def _generate(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until no row is left and nobody waits: join the waiting requests, decode one step, hand back
        the finished turns (on the generation thread)."""
        batch = DecodeBatch(self.model, pad_token_id=self.pad_token_id, temperature=self.config.temperature,
                            top_p=self.config.top_p, decode=self.decode, timings=self.timings)
        joining: list[tuple[asyncio.Future[GenerationOutput], GenerationRequest]] = []
        try:
            while not self.closed:
                joining = self._take(self.config.max_batch_size - len(batch))
                if joining:
                    self._hand_back(loop, batch.add(joining))
                if not batch:
                    return
                self._hand_back(loop, batch.step())
        except Exception as exc:  # noqa: BLE001 - fail the rollouts waiting on this batch, not the loop
            for future in [*(row.key for row in batch.rows), *(future for future, _ in joining)]:
                loop.call_soon_threadsafe(_fail, future, exc)
        finally:
            self.prefill_tokens += batch.prefill_tokens
            self.prefill_rows += batch.prefill_rows
            self.largest_batch = max(self.largest_batch, batch.largest)

    def _take(self, room: int) -> list[tuple[asyncio.Future[GenerationOutput], GenerationRequest]]:
        with self.lock:
            taken, self.pending = self.pending[:max(room, 0)], self.pending[max(room, 0):]
            for request, _ in taken:
                if request.prefix is not None:
                    self.kept_bytes -= request.prefix.nbytes  # copied into the batch's cache
        return [(future, request) for request, future in taken]

    def _hand_back(self, loop: asyncio.AbstractEventLoop, finished: list[tuple[Any, GenerationOutput]]) -> None:
        for future, output in finished:
            if output.cache is not None:
                with self.lock:
                    if self.kept_bytes + output.cache.nbytes > self.config.kv_cache_mb * 2**20:
                        output.cache = None  # over the bound: this rollout's next turn re-prefills
                    else:
                        self.kept_bytes += output.cache.nbytes
            loop.call_soon_threadsafe(_resolve, future, output)

    async def _gather(self) -> None:
        """Wait (at most batch_wait_s) until every live rollout is waiting for the model, or a full batch is."""
        deadline = time.perf_counter() + self.config.batch_wait_s
        while len(self.pending) < min(self.live, self.config.max_batch_size):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=remaining)
            except TimeoutError:
                return


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class RolloutEngine:
    def __init__(self, model: Any, tokenizer: Any, formatter: ChatFormatter, tool_client: Any,
                 config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer, self.formatter, self.tools = model, tokenizer, formatter, tool_client
        self.config = config or EngineConfig()
        self.max_context = self.config.max_context_tokens or getattr(model.config, "max_position_embeddings", 8192)
        self.stop_token_ids = frozenset(formatter.stop_token_ids())
        self.stop_strings = tuple(formatter.parser.stop_strings)
        # Of the last run: time inside the model, and of it prefill_s and decode_s; tokens fed by
        # prefills, requests joined by each prefill, most rows decoding at once.
        self.generation_s = 0.0
        self.generation_timings: dict[str, float] = {}
        self.prefill_tokens = 0
        self.prefill_rows: list[int] = []
        self.largest_batch = 0

    async def run(self, specs: list[RolloutSpec]) -> list[RolloutRecord]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batcher = _Batcher(self.model, pad_token_id=pad, config=self.config, decode=self.formatter.decode)
        with sampling_weights(self.model) if self.config.sampling_weights else nullcontext():
            loop_task = asyncio.create_task(batcher.run())
            try:
                return list(await asyncio.gather(*(self._rollout(spec, batcher) for spec in specs)))
            finally:
                batcher.close()
                await loop_task  # the generation thread's last step, so the model is free and the counts final
                self._keep_counts(batcher)

    def _keep_counts(self, batcher: _Batcher) -> None:
        self.generation_s, self.generation_timings = batcher.generation_s, dict(batcher.timings)
        self.prefill_tokens, self.prefill_rows = batcher.prefill_tokens, batcher.prefill_rows
        self.largest_batch = batcher.largest_batch
        release_freed_memory()  # the run's KV caches, of new shapes every run (models.release_freed_memory)

    async def _rollout(self, spec: RolloutSpec, batcher: _Batcher) -> RolloutRecord:
        started = time.perf_counter()
        record = RolloutRecord(trace_id=f"trace_{uuid.uuid4().hex}", sample_index=spec.sample_index,
                               messages=list(spec.messages))
        state = _Episode(self, spec, record, batcher)
        batcher.started()
        try:
            await state.play()
        finally:
            batcher.release(state.kv)
            batcher.finished()
            record.wall_time_s = time.perf_counter() - started
        return record


class _Episode:
    """One rollout's turn loop."""

    def __init__(self, engine: RolloutEngine, spec: RolloutSpec, record: RolloutRecord, batcher: _Batcher) -> None:
        self.engine, self.spec, self.record, self.batcher = engine, spec, record, batcher
        self.cfg = engine.config
        self.fmt = engine.formatter
        self.kv: KVPrefix | None = None  # this rollout's attention cache from its last turn, if kept
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
                                    prefix=self.kv, keep_cache=self.batcher.keeps_caches)
        self.kv = None  # handed to the batch (the batcher accounts for it)
        output = await self.batcher.generate(request)
        self.kv, output.cache = output.cache, None
        self._append(output.token_ids, sampled=True, logprobs=output.logprobs)
        record.completion_tokens += len(output.token_ids)
        if output.finish != "stop" and len(record.token_ids) >= self.engine.max_context:
            self._finish("truncated")
            return None
        return output

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

        result = await self.engine.tools.call(trace_id=self.record.trace_id, call_id=call.call_id, name=call.name,
                                              arguments_json=call.arguments_json, item=self.spec.item,
                                              on_cancel=record_cancelled)
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


def dumps_record(record: RolloutRecord) -> str:
    return json.dumps(asdict(record))
