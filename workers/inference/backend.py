"""The inference server's generation backends, and what they share: requests answered through the
sampler seam (workers/engine/sampler.py), the same one the rollout engine samples through.

A backend takes each checked request as a `Pending` (`submit`, or QueueFull at once) and answers on
the request's own asyncio queue: ("accepted", plan) or ("error", exc) first, then ("delta", choice
index, text) while it streams, then ("done", plan, [(ChoiceRow, ChoiceResult)]). Two backends:
`EngineBackend` (workers/inference/engine_backend.py, AGENT_RFT_INFERENCE_BACKEND=engine: the
engine's continuous batching on the models this process loads) and `VLLMBackend`
(workers/inference/vllm_backend.py: the vLLM fleet). Either way a request's choices are generated
by `answer_on`, on a sampling session of its model. No torch here.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from workers.inference.chat import ChatPlan, ChoiceResult, ChoiceStream, finish_choice
from workers.inference.served import ServedModel
from workers.engine.sampler import OnToken, SamplingSession

# The openai SDK waits out a Retry-After only up to a bound (60 s in older versions, 120 s now).
RETRY_AFTER_MAX_S = 60
TIME_WEIGHT = 0.3  # weight of the latest duration in the running mean of durations


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are waiting")
        self.waiting, self.retry_after_s = waiting, retry_after_s


def retry_after(expected_s: float | None) -> int:
    """Whole seconds to wait before a retry, when room is expected in `expected_s` (unknown: 1 s)."""
    return min(RETRY_AFTER_MAX_S, max(1, math.ceil(expected_s if expected_s is not None else 1.0)))


def running_mean(previous: float | None, value: float) -> float:
    return value if previous is None else previous + TIME_WEIGHT * (value - previous)


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
    def model_key(self) -> tuple[str, str | None]:
        """Requests with the same key are generated on the same weights."""
        return self.model["base"].casefold(), self.model.get("checkpoint_path")

    def rows(self) -> int:
        return int(self.request.get("n") or 1)


@dataclass
class ChoiceRow:
    """One choice of a request being generated (a request has n)."""

    pending: Pending
    chat: ChatPlan
    choice: int
    stream: ChoiceStream | None  # turns its tokens into content deltas, when the request streams

    def on_token(self, token: int) -> None:
        self.pending.saw_token()
        if self.stream is not None and (text := self.stream.feed(token)):
            self.pending.events.put_nowait(("delta", self.choice, text))


class GenerationBackend(Protocol):
    async def start(self) -> None:
        """Ready to answer (models loaded, servers checked); raises when it cannot serve."""
        ...

    async def stop(self) -> None: ...

    def submit(self, pending: Pending) -> None:
        """Start answering `pending` on its queue; QueueFull at once when at capacity."""
        ...

    def health(self) -> dict[str, Any]: ...


async def answer_on(session: SamplingSession, pending: Pending, chat: ChatPlan,
                    served: ServedModel) -> list[tuple[ChoiceRow, ChoiceResult]]:
    """Every choice of `pending` generated on `session` (each token handed to its row as it is drawn:
    the time-to-first-token metric, and the deltas of a stream), read as OpenAI's choices."""
    rows = [ChoiceRow(pending, chat, index, ChoiceStream(chat, served) if pending.stream else None)
            for index in range(len(chat.generations))]
    # The request's choices share one server (affinity): its prefix cache holds the prompt once.
    requests = [replace(chat.generations[row.choice], affinity=chat.id) for row in rows]
    on_tokens: list[OnToken] = [row.on_token for row in rows]
    outputs = await asyncio.gather(*(session.generate(request, on_token)
                                     for request, on_token in zip(requests, on_tokens)))
    return [(row, finish_choice(chat, served, row.choice, output)) for row, output in zip(rows, outputs)]
