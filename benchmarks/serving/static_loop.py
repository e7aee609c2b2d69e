"""THE BASELINE of benchmarks/serving, frozen: the inference server's engine backend as it was before
serving went through the sampler seam. A loop takes the oldest request, waits `batch_window_s` for
others of the same model and sampling settings, and generates all their rows in one static batch
(`generate_batch`): a batch runs to its longest row, and a request arriving meanwhile waits for the
next batch. Kept here, unchanged but for the imports, so that the benchmark measures the unified
path against it in the same run; nothing in the service uses it."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.inference.backend import ChoiceRow, Pending, QueueFull, retry_after, running_mean
from workers.inference.chat import BadChatRequest, ChoiceStream, finish_choice, plan
from workers.inference.pool import ModelPool, ModelUnavailable, ServedModel
from workers.engine.generation import GenerationRequest, generate_batch
from workers.models.loading import release_freed_memory

log = logging.getLogger(__name__)


def _group(pending: Pending) -> tuple[Any, ...]:
    r = pending.request
    return (pending.model["base"].casefold(), pending.model.get("checkpoint_path"), r.get("temperature"), r.get("top_p"))


class StaticScheduler:
    """The engine backend as it was: a model pool and one generation thread, one static batch at a time."""

    def __init__(self, pool: ModelPool, *, max_batch_size: int, batch_window_s: float, default_max_tokens: int,
                 max_waiting: int, preload: list[str] | None = None) -> None:
        self.pool = pool
        self.preload = preload or []  # base models to load before the server says it is ready
        self._loop_task: asyncio.Task[None] | None = None
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.generating = 0  # requests in the batch being generated
        self.batch_seconds: float | None = None  # running mean of how long a batch takes
        self.batch_window_s = batch_window_s
        self.default_max_tokens = default_max_tokens
        self.pending: list[Pending] = []
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation")

    async def start(self) -> None:
        for base in self.preload:
            await self.in_generation_thread(self.pool.get, base, None)
        self._loop_task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def health(self) -> dict[str, Any]:
        pool = self.pool
        return {"backend": "engine", "bases": list(pool.allowed_bases.values()), "pool": pool.loaded_keys(),
                "pool_capacity": pool.capacity, "loads": pool.stats.loads, "evictions": pool.stats.evictions,
                "preparations": pool.stats.preparations, "queue": self.queue_state()}

    def submit(self, pending: Pending) -> None:
        """Queue `pending`, or raise QueueFull when `max_waiting` requests already wait."""
        if len(self.pending) >= self.max_waiting:
            raise QueueFull(len(self.pending), self.retry_after_s())
        self.pending.append(pending)
        self.wake.set()

    def retry_after_s(self) -> int:
        """Whole seconds until the running batch is likely done and a waiting request is taken."""
        return retry_after(self.batch_seconds)

    def queue_state(self) -> dict[str, int]:
        return {"waiting": len(self.pending), "generating": self.generating, "max_waiting": self.max_waiting}

    def _record_batch_time(self, seconds: float) -> None:
        self.batch_seconds = running_mean(self.batch_seconds, seconds)

    async def in_generation_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if not self.pending:
                continue
            if self.batch_window_s:
                await asyncio.sleep(self.batch_window_s)  # let requests for the same model join
            batch = self._take_batch()
            self.generating, started = len(batch), time.monotonic()
            try:
                await self._generate_in_thread(batch)
            finally:
                self.generating = 0
            self._record_batch_time(time.monotonic() - started)
            if self.pending:
                self.wake.set()

    async def _generate_in_thread(self, batch: list[Pending]) -> None:
        try:
            await self.in_generation_thread(self._generate, batch, asyncio.get_running_loop())
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            log.exception("generation failed")
            for pending in batch:
                pending.events.put_nowait(("error", exc))

    def _take_batch(self) -> list[Pending]:
        head = self.pending[0]
        batch, rows = [], 0
        for pending in list(self.pending):
            if _group(pending) != _group(head) or (batch and rows + pending.rows() > self.max_batch_size):
                continue
            batch.append(pending)
            rows += pending.rows()
            self.pending.remove(pending)
        return batch

    # -- on the generation thread -----------------------------------------------------------------

    def _generate(self, batch: list[Pending], loop: asyncio.AbstractEventLoop) -> None:
        def send(pending: Pending, *event: Any) -> None:
            loop.call_soon_threadsafe(pending.events.put_nowait, event)

        head = batch[0].model
        try:
            served = self.pool.get(head["base"], head.get("checkpoint_path"))
        except ModelUnavailable as exc:
            for pending in batch:
                send(pending, "error", exc)
            return
        rows = self._plan_rows(batch, served, send)
        if not rows:
            return

        def on_token(row: int, token: int) -> None:
            entry = rows[row]
            entry.pending.saw_token()
            if entry.stream is not None and (text := entry.stream.feed(token)):
                send(entry.pending, "delta", entry.choice, text)

        requests: list[GenerationRequest] = [r.chat.generations[r.choice] for r in rows]
        tokenizer = served.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        try:
            module = self.pool.prepared(served)
            outputs = generate_batch(module, requests, pad_token_id=pad, temperature=requests[0].temperature,
                                     top_p=requests[0].top_p, decode=served.formatter.decode, on_token=on_token)
        finally:
            release_freed_memory()  # KV caches of a new shape every batch (models.release_freed_memory)
        results: dict[int, list[Any]] = {}
        for entry, output in zip(rows, outputs):
            result = finish_choice(entry.chat, served, entry.choice, output)
            results.setdefault(id(entry.pending), [entry.pending, entry.chat, []])[2].append((entry, result))
        for pending, chat, done in results.values():
            send(pending, "done", chat, done)

    def _plan_rows(self, batch: list[Pending], served: ServedModel, send: Any) -> list[ChoiceRow]:
        rows: list[ChoiceRow] = []
        for pending in batch:
            try:
                chat = plan(pending.request, pending.model["name"], served, default_max_tokens=self.default_max_tokens)
            except BadChatRequest as exc:
                send(pending, "error", exc)
                continue
            send(pending, "accepted", chat)
            rows += [ChoiceRow(pending, chat, index, ChoiceStream(chat, served) if pending.stream else None)
                     for index in range(len(chat.generations))]
        return rows
