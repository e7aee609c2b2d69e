"""The inference server's generation backends, and the engine's: batching on the models it loads.

A backend takes each checked request as a `Pending` (`submit`, or QueueFull at once) and answers on
the request's own asyncio queue: ("accepted", plan) or ("error", exc) first, then ("delta", choice
index, text) while it streams, then ("done", plan, [(ChoiceRow, ChoiceResult)]). Two backends:
`Scheduler` here (AGENT_RFT_INFERENCE_BACKEND=engine) and `VLLMBackend`
(workers/inference/vllm_backend.py).

Batching: requests for the same model (and sampling settings) are generated together.

Every request becomes a `Pending`; a loop takes the oldest one, waits `batch_window_s` for
others of the same model to arrive, and generates all their rows (n per request) in one
`generate_batch` call on the inference server's single generation thread, which is also the only
thread that touches the model pool.

The queue is bounded: at most `max_waiting` requests wait for a batch (those taken into the batch
being generated are not counted). Past it, `submit` raises QueueFull at once, with the seconds
after which a retry should find room: a request waiting now is taken when the running batch ends,
so that is about one batch's time (the mean of the recent ones).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.inference.chat import BadChatRequest, ChatPlan, ChoiceStream, finish_choice, plan
from workers.inference.pool import ModelPool, ModelUnavailable, ServedModel
from workers.rl.generation import GenerationRequest, generate_batch
from workers.rl.models import release_freed_memory

log = logging.getLogger(__name__)
# The openai SDK waits out a Retry-After only up to a bound (60 s in older versions, 120 s now).
RETRY_AFTER_MAX_S = 60
BATCH_TIME_WEIGHT = 0.3  # weight of the latest batch in the running mean of batch durations


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are waiting")
        self.waiting, self.retry_after_s = waiting, retry_after_s


def retry_after(expected_s: float | None) -> int:
    """Whole seconds to wait before a retry, when room is expected in `expected_s` (unknown: 1 s)."""
    return min(RETRY_AFTER_MAX_S, max(1, math.ceil(expected_s if expected_s is not None else 1.0)))


def running_mean(previous: float | None, value: float) -> float:
    return value if previous is None else previous + BATCH_TIME_WEIGHT * (value - previous)


@dataclass
class Pending:
    request: dict[str, Any]
    model: dict[str, Any]  # {"name", "base", "checkpoint_path"} as the API resolved it
    stream: bool
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # time.monotonic() at arrival and at its first sampled token (the server's time-to-first-token metric)
    received_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    def saw_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    @property
    def group(self) -> tuple[Any, ...]:
        r = self.request
        return (self.model["base"].casefold(), self.model.get("checkpoint_path"), r.get("temperature"), r.get("top_p"))

    def rows(self) -> int:
        return int(self.request.get("n") or 1)


@dataclass
class ChoiceRow:
    """One choice of a request being generated (a request has n)."""

    pending: Pending
    chat: ChatPlan
    choice: int
    stream: ChoiceStream | None  # turns its tokens into content deltas, when the request streams


class GenerationBackend(Protocol):
    async def start(self) -> None:
        """Ready to answer (models loaded, servers checked); raises when it cannot serve."""
        ...

    async def stop(self) -> None: ...

    def submit(self, pending: Pending) -> None:
        """Start answering `pending` on its queue; QueueFull at once when at capacity."""
        ...

    def health(self) -> dict[str, Any]: ...


class Scheduler:
    """The engine backend: a model pool and one generation thread."""

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
            if pending.group != head.group or (batch and rows + pending.rows() > self.max_batch_size):
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
            with self.pool.generating(served) as module:
                outputs = generate_batch(module, requests, pad_token_id=pad, temperature=rows[0].chat.temperature,
                                         top_p=rows[0].chat.top_p, decode=served.formatter.decode, on_token=on_token)
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
