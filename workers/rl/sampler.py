"""The sampler seam: what the rollout engine generates through.

A `Sampler` turns token ids into sampled token ids, their log-probs under the sampling policy
and a finish reason (`GenerationRequest` -> `GenerationOutput`, workers/rl/generation.py). The
rollout engine opens one `SamplingSession` per run of rollouts; the session's counters feed the
step's metrics. After an optimizer step the trainer hands the sampler the current policy
(`publish_policy`), with a version number that the step's metrics carry.

Implementations:
- `InProcessSampler` (here): the engine's own continuous batching on the worker's model, with the
  CPU speed-ups of models.sampling_weights. The policy is the model being trained, so publishing
  is a version bump.
- `VLLMSampler` (workers/rl/vllm_sampler.py): one or more vLLM servers over HTTP, token-in/token-out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from workers.rl.generation import DecodeBatch, GenerationOutput, GenerationRequest, KVPrefix
from workers.rl.models import release_freed_memory, sampling_weights

if TYPE_CHECKING:
    from workers.rl.rollout import EngineConfig


class SamplerUnavailable(RuntimeError):
    """The sampler cannot generate at all (e.g. no inference server answers): the job fails with
    this message, it does not hang."""


class SamplingSession(Protocol):
    """One run of rollouts on a sampler. `started`/`finished` bracket each rollout (a batching
    sampler waits for live rollouts to join a batch); `release` gives back a kept KV cache."""

    keeps_caches: bool
    generation_s: float  # time spent generating (the model busy, or requests in flight)
    timings: dict[str, float]  # of that time, where known: prefill_s, decode_s
    prefill_tokens: int  # prompt tokens the sampler had to process
    prefill_rows: list[int]  # requests joined by each prefill (in-process only)
    largest_batch: int  # most requests generating at once

    def started(self) -> None: ...
    def finished(self) -> None: ...
    def release(self, cache: KVPrefix | None) -> None: ...
    async def generate(self, request: GenerationRequest) -> GenerationOutput: ...


class Sampler(Protocol):
    policy_version: int  # of the weights sampled now; 0 before the first optimizer step
    needs_adapter_files: bool  # publish_policy reads the LoRA adapter from disk (another process samples)
    failovers: list[Any]  # servers that failed a request (`.server`, `.error`), oldest first, for the step's events

    def session(self) -> AbstractAsyncContextManager[SamplingSession]: ...

    async def publish_policy(self, version: int, adapter_dir: Path | None) -> None:
        """Sample from the policy of `version` from now on; `adapter_dir` holds its LoRA adapter
        (saved by the trainer) for samplers that do not share the trainer's memory."""
        ...


class InProcessSampler:
    """The engine's own sampler on the worker's model (in training: the very module being trained)."""

    needs_adapter_files = False  # it samples the trainer's own module

    def __init__(self, model: Any, *, pad_token_id: int, config: EngineConfig, decode: Any) -> None:
        self.model, self.pad_token_id, self.config, self.decode = model, pad_token_id, config, decode
        self.policy_version = 0
        self.failovers: list[Any] = []  # one process, no servers to fail

    @asynccontextmanager
    async def session(self) -> AsyncIterator[SamplingSession]:
        batcher = _Batcher(self.model, pad_token_id=self.pad_token_id, config=self.config, decode=self.decode)
        with sampling_weights(self.model) if self.config.sampling_weights else nullcontext():
            loop_task = asyncio.create_task(batcher.run())
            try:
                yield batcher
            finally:
                batcher.close()
                await loop_task  # the generation thread's last step, so the model is free and the counts final
        release_freed_memory()  # the run's KV caches, of new shapes every run (models.release_freed_memory)

    async def publish_policy(self, version: int, adapter_dir: Path | None) -> None:
        self.policy_version = version  # the model object is the policy: nothing to copy


class _Batcher:  # the in-process SamplingSession
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
