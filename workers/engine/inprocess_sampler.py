"""The in-process sampler (the `Sampler` seam of workers/engine/sampler.py): the engine's own
continuous batching on a model in this process, with the CPU speed-ups of models.sampling_weights.
In training the policy is the model being trained, so publishing is a version bump; the inference
server's engine backend opens one session per model it serves (workers/inference/engine_backend.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.generation import DecodeBatch, KVPrefix
from workers.models.cpu.cpu_speedups import sampling_weights
from workers.models.loading import release_freed_memory
from workers.engine.sampler import GenerationOutput, GenerationRequest, OnToken, SamplingSession

if TYPE_CHECKING:
    from workers.engine.rollout import EngineConfig


class InProcessSampler:
    """The engine's own sampler on `model` (in training: the very module being trained).

    `executor`: the thread the model is run on (default: asyncio's pool); the inference server
    passes its one generation thread, the only one that touches its model pool."""

    needs_adapter_files = False  # it samples the trainer's own module

    def __init__(self, model: Any, *, pad_token_id: int, config: EngineConfig, decode: Any,
                 executor: Executor | None = None) -> None:
        self.model, self.pad_token_id, self.config, self.decode = model, pad_token_id, config, decode
        self.executor = executor
        self.policy_version = 0
        self.failovers: list[Any] = []  # one process, no servers to fail

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 8192))

    @asynccontextmanager
    async def session(self) -> AsyncIterator[SamplingSession]:
        batcher = _Batcher(self)
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


@dataclass
class _Turn:
    """A request in the batch: its caller's future, and who takes its tokens as they are drawn."""

    future: asyncio.Future[GenerationOutput]
    on_token: OnToken | None


class _Batcher:  # the in-process SamplingSession
    """Continuous batching across every rollout of a run: one DecodeBatch on a generation thread;
    a rollout's request joins it at the next decode step, and its turn comes back the moment it is
    done (its tool calls start while other rows still decode). Each rollout's attention cache is
    kept across its tool calls within `kv_cache_mb`; over that, a turn re-prefills its context."""

    def __init__(self, sampler: InProcessSampler) -> None:
        self.sampler = sampler  # its policy_version: the weights do not change while a session runs
        self.model, self.pad_token_id, self.decode = sampler.model, sampler.pad_token_id, sampler.decode
        self.config, self.executor = sampler.config, sampler.executor
        self.pending: list[tuple[GenerationRequest, _Turn]] = []
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

    async def generate(self, request: GenerationRequest, on_token: OnToken | None = None) -> GenerationOutput:
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        with self.lock:
            self.pending.append((request, _Turn(future, on_token)))
        self.wake.set()
        output = await future
        output.policy_version = self.sampler.policy_version
        return output

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
                await loop.run_in_executor(self.executor, self._generate, loop)
            finally:
                self.generation_s += time.perf_counter() - started
            if self.pending:
                self.wake.set()

    def _generate(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until no row is left and nobody waits: join the waiting requests, decode one step, hand back
        the finished turns (on the generation thread)."""
        def on_token(turn: _Turn, token: int) -> None:
            if turn.on_token is not None:
                loop.call_soon_threadsafe(turn.on_token, token)

        batch = DecodeBatch(self.model, pad_token_id=self.pad_token_id, temperature=self.config.temperature,
                            top_p=self.config.top_p, decode=self.decode, on_token=on_token, timings=self.timings)
        joining: list[tuple[_Turn, GenerationRequest]] = []
        try:
            while not self.closed:
                joining = self._take(self.config.max_batch_size - len(batch))
                if joining:
                    self._hand_back(loop, batch.add(joining))
                if not batch:
                    return
                self._hand_back(loop, batch.step())
        except Exception as exc:  # noqa: BLE001 - fail the rollouts waiting on this batch, not the loop
            for turn in [*(row.key for row in batch.rows), *(turn for turn, _ in joining)]:
                loop.call_soon_threadsafe(_fail, turn.future, exc)
        finally:
            self.prefill_tokens += batch.prefill_tokens
            self.prefill_rows += batch.prefill_rows
            self.largest_batch = max(self.largest_batch, batch.largest)

    def _take(self, room: int) -> list[tuple[_Turn, GenerationRequest]]:
        with self.lock:
            taken, self.pending = self.pending[:max(room, 0)], self.pending[max(room, 0):]
            for request, _ in taken:
                if request.prefix is not None:
                    self.kept_bytes -= request.prefix.nbytes  # copied into the batch's cache
        return [(turn, request) for request, turn in taken]

    def _hand_back(self, loop: asyncio.AbstractEventLoop, finished: list[tuple[_Turn, GenerationOutput]]) -> None:
        for turn, output in finished:
            if output.cache is not None:
                with self.lock:
                    if self.kept_bytes + output.cache.nbytes > self.config.kv_cache_mb * 2**20:
                        output.cache = None  # over the bound: this rollout's next turn re-prefills
                    else:
                        self.kept_bytes += output.cache.nbytes
            loop.call_soon_threadsafe(_resolve, turn.future, output)

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
