"""The sampler seam: what the rollout engine and the inference server generate through.

A `Sampler` turns token ids into sampled token ids, their log-probs under the sampling policy
and a finish reason (`GenerationRequest` -> `GenerationOutput`). A caller opens one
`SamplingSession` per run of requests (a step's rollouts, or a model's requests on the inference
server); the session's counters feed the step's metrics. After an optimizer step the trainer hands
the sampler the current policy (`publish_policy`), with a version number that the step's metrics
carry.

This module imports no torch: a front end of a vLLM fleet holds tokenizers only. What a session
keeps between a rollout's turns (an attention cache) is an opaque handle to the caller: it hands
back `GenerationOutput.cache` as the next turn's `GenerationRequest.prefix`, and gives it up with
`SamplingSession.release`.

Implementations:
- `InProcessSampler` (workers/engine/inprocess_sampler.py): the engine's own continuous batching on a
  model in this process (in training: the very module being trained).
- `VLLMSampler` (workers/engine/vllm_sampler.py): one or more vLLM servers over HTTP, token-in/token-out.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Called with each sampled token id as it is drawn, on the caller's event loop (streaming).
OnToken = Callable[[int], None]


class SamplerUnavailable(RuntimeError):
    """The sampler cannot generate at all (e.g. no inference server answers): the job fails with
    this message, it does not hang."""


class CacheHandle(Protocol):
    """A session's kept cache of the first `length` tokens of a rollout's next context."""

    length: int

    @property
    def nbytes(self) -> int: ...


@dataclass
class GenerationRequest:
    context_ids: list[int]
    max_new_tokens: int
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()  # e.g. "</tool_call>": checked on the decoded tail
    prefix: CacheHandle | None = None  # the session's cache of context_ids[:prefix.length], if kept
    keep_cache: bool = False  # hand back the row's cache (GenerationOutput.cache) for its next turn
    affinity: str | None = None  # requests with the same key (a rollout's turns) go to the same server, if several
    # Structured outputs: the tokens each step may take (workers/engine/constraints.Constraint); its
    # sequence ends as a stop once the value is complete. One per request: it keeps the state.
    constraint: Any = None
    # This request's sampling settings; None: the session's (a served request carries its own).
    temperature: float | None = None
    top_p: float | None = None


@dataclass
class GenerationOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"  # "stop" (an end-of-turn token was sampled) or "length"
    cache: CacheHandle | None = None  # when the request asked for it: context + token_ids[:-1]
    policy_version: int | None = None  # of the policy that sampled this turn (training samplers set it)


class SamplingSession(Protocol):
    """One run of requests on a sampler. `started`/`finished` bracket each rollout (a batching
    sampler waits for live rollouts to join a batch); `release` gives back a kept cache."""

    keeps_caches: bool
    generation_s: float  # time spent generating (the model busy, or requests in flight)
    timings: dict[str, float]  # of that time, where known: prefill_s, decode_s
    prefill_tokens: int  # prompt tokens the sampler had to process
    prefill_rows: list[int]  # requests joined by each prefill (in-process only)
    largest_batch: int  # most requests generating at once

    def started(self) -> None: ...
    def finished(self) -> None: ...
    def release(self, cache: CacheHandle | None) -> None: ...
    async def generate(self, request: GenerationRequest, on_token: OnToken | None = None) -> GenerationOutput: ...


class Sampler(Protocol):
    policy_version: int  # of the weights sampled now; 0 before the first optimizer step
    needs_adapter_files: bool  # publish_policy reads the LoRA adapter from disk (another process samples)
    failovers: list[Any]  # servers that failed a request (`.server`, `.error`), oldest first, for the step's events

    @property
    def max_context(self) -> int | None:
        """The most tokens (context and sampled together) one request may span; None: not known yet."""
        ...

    def session(self) -> AbstractAsyncContextManager[SamplingSession]: ...

    async def publish_policy(self, version: int, adapter_dir: Path | None) -> None:
        """Sample from the policy of `version` from now on; `adapter_dir` holds its LoRA adapter
        (saved by the trainer) for samplers that do not share the trainer's memory."""
        ...
