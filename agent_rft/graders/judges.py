"""Model judges for `score_model` / `label_model`, and the outbound HTTP that graders share.

A judge is either an OpenAI-compatible chat-completions endpoint (AGENT_RFT_JUDGE_BASE_URL)
or a local transformers model (AGENT_RFT_JUDGE_LOCAL_MODEL). Both answer a list of chat
messages with a `JudgeReply`; failures to get an answer raise GraderError with
`model_grader_server_error`.

The outbound half (`post_json`, `http_client`) is also what the `endpoint` grader uses:
one SSRF-guarded, pooled httpx client per context and event loop, and retries with backoff
(the policy of agent_rft.retry). Backpressure is not failure: a 429/503 with Retry-After waits
as asked (at most `ctx.max_retry_after_s`) without spending an attempt, and each URL's
concurrency adapts (AIMD, agent_rft.concurrency, up to `ctx.max_concurrency_per_url`).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import RetryCallState, retry_if_exception_type

from agent_rft.concurrency import Backpressure
from agent_rft.extras import missing_extra
from agent_rft.retry import THROTTLE_STATUS, async_retrying, excerpt, retryable_status, throttle_wait_s
from agent_rft.tracing import traceparent
from agent_rft.urls import BlockedURL, guard_url, guarded_client
from agent_rft.graders.core import GraderContext, GraderError
from agent_rft.graders.templating import content_text

RETRY_BACKOFF_S = 0.5  # first backoff; doubled per retry, with jitter
RETRY_BACKOFF_MAX_S = 8.0
NO_JUDGE_MESSAGE = (
    "no judge model is configured for score_model/label_model graders: set AGENT_RFT_JUDGE_BASE_URL "
    "(an OpenAI-compatible chat-completions endpoint) or AGENT_RFT_JUDGE_LOCAL_MODEL (a local model)"
)
LOCAL_DEFAULT_MAX_TOKENS = 256


# --- outbound HTTP shared by graders -------------------------------------------------------


class Unresponsive(Exception):
    """No usable answer after every attempt (5xx, 408/429, timeouts, connection errors). One
    attempt's carries its status and Retry-After, so that backpressure is waited out."""

    def __init__(self, message: str, *, status_code: int | None = None, headers: httpx.Headers | None = None) -> None:
        super().__init__(message)
        self.status_code, self.headers = status_code, headers or httpx.Headers()

    @property
    def throttled(self) -> bool:
        return self.status_code in THROTTLE_STATUS


def loop_state(ctx: GraderContext) -> dict[str, Any]:
    """State bound to the running event loop (httpx clients and rate limiters cannot be
    shared across loops), kept in ctx.shared so that it lives as long as the context."""
    per_loop = ctx.shared.setdefault("graders.per_loop", weakref.WeakKeyDictionary())
    return per_loop.setdefault(asyncio.get_running_loop(), {})


def http_client(ctx: GraderContext) -> httpx.AsyncClient:
    """ctx.http_client when the deployment gave one, else one pooled guarded client per loop."""
    if ctx.http_client is not None:
        return ctx.http_client
    state = loop_state(ctx)
    if "http_client" not in state:
        state["http_client"] = guarded_client(
            ctx.outbound_allowlist, timeout=ctx.request_timeout_s,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
    return state["http_client"]


async def close_http_client(ctx: GraderContext) -> None:
    """Close the client this loop's gradings opened (not a ctx.http_client the caller owns)."""
    client = loop_state(ctx).pop("http_client", None)
    if client is not None:
        await client.aclose()


def _backpressure(ctx: GraderContext, url: str) -> Backpressure:
    """One URL's adaptive concurrency and throttling account, shared by every grading on this loop."""
    per_url = loop_state(ctx).setdefault("backpressure", {})
    if url not in per_url:
        per_url[url] = Backpressure.up_to(ctx.max_concurrency_per_url)
    return per_url[url]


def backpressure_stats(ctx: GraderContext) -> dict[str, dict[str, float]]:
    """Per URL called from this loop: throttled answers, seconds waited for them, the current
    concurrency limit and its ceiling."""
    return {url: b.stats() for url, b in loop_state(ctx).get("backpressure", {}).items()}


async def _check_url(url: str, ctx: GraderContext) -> None:
    # A client the deployment supplied may not carry the guard; ours checks each request itself.
    if ctx.http_client is not None:
        await asyncio.to_thread(guard_url, url, ctx.outbound_allowlist)


async def _post_once(client: httpx.AsyncClient, url: str, body: Any, headers: dict[str, str], timeout: float) -> httpx.Response:
    try:
        response = await client.post(url, json=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise Unresponsive(f"no answer from {url} within {timeout:g} s") from None
    except httpx.TransportError as exc:
        raise Unresponsive(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if retryable_status(response.status_code):
        raise Unresponsive(f"{url} answered {response.status_code}: {excerpt(response.text)}",
                           status_code=response.status_code, headers=response.headers)
    return response


async def post_json(
    url: str, body: Any, ctx: GraderContext, *, headers: dict[str, str] | None = None,
    attempts: int, limiter: Any = None, trace_id: str | None = None,
) -> httpx.Response:
    """POST JSON with retries on transient failures; returns the first non-transient response.

    Raises Unresponsive once `attempts` tries failed, BlockedURL when the SSRF guard refuses
    the URL. `limiter` (an async context manager) is entered before every attempt. With a
    `trace_id` (the rollout's), every attempt carries a W3C `traceparent` of that trace.
    """
    await _check_url(url, ctx)
    client = http_client(ctx)

    def attempt_headers() -> dict[str, str]:
        return {**(headers or {}), "traceparent": traceparent(trace_id)} if trace_id else headers or {}

    async def attempt() -> httpx.Response:
        if limiter is None:
            return await _post_once(client, url, body, attempt_headers(), ctx.request_timeout_s)
        async with limiter:
            return await _post_once(client, url, body, attempt_headers(), ctx.request_timeout_s)

    backpressure = _backpressure(ctx, url)

    async def limited_attempt() -> httpx.Response:
        # The URL's AIMD concurrency: a throttled answer halves it, successes grow it back.
        async with backpressure.limit.held() as hold:
            try:
                return await attempt()
            except Unresponsive as exc:
                hold.throttled = exc.throttled
                raise

    def asked_wait(retry_state: RetryCallState) -> float | None:
        exc = retry_state.outcome.exception()  # type: ignore[union-attr]
        if not isinstance(exc, Unresponsive) or exc.status_code is None:
            return None
        return throttle_wait_s(exc.status_code, exc.headers, ctx.max_retry_after_s)

    policy = async_retrying(attempts=attempts, base_s=RETRY_BACKOFF_S, max_s=RETRY_BACKOFF_MAX_S,
                            retry=retry_if_exception_type(Unresponsive), throttle=asked_wait,
                            throttle_budget_s=ctx.max_throttle_wait_s)
    try:
        return await policy(limited_attempt)
    except Unresponsive as exc:
        raise Unresponsive(f"{exc} (after {attempts} attempts)") from None
    finally:
        backpressure.count(policy.statistics)


# --- judges ----------------------------------------------------------------------------------


@dataclass
class JudgeReply:
    content: str
    model: str
    finish_reason: str | None = None
    refusal: str | None = None
    usage: dict[str, int] = field(default_factory=dict)


async def ask_judge(model: str, messages: list[dict[str, Any]], sampling: dict[str, Any], ctx: GraderContext,
                    trace_id: str | None = None) -> JudgeReply:
    """One chat completion from the configured judge (remote endpoint first, else local model).
    `trace_id`: the graded rollout's, sent to a remote judge as a `traceparent`."""
    if ctx.judge_base_url:
        return await _ask_remote(model, messages, sampling, ctx, trace_id)
    if ctx.judge_local_model:
        return await _ask_local(messages, sampling, ctx)
    raise GraderError("model_grader_server_error", NO_JUDGE_MESSAGE)


async def _ask_remote(model: str, messages: list[dict[str, Any]], sampling: dict[str, Any], ctx: GraderContext,
                      trace_id: str | None = None) -> JudgeReply:
    url = ctx.judge_base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {ctx.judge_api_key}"} if ctx.judge_api_key else {}
    body = {**sampling, "model": model, "messages": messages}
    try:
        response = await post_json(url, body, ctx, headers=headers, attempts=3, trace_id=trace_id)
    except Unresponsive as exc:
        raise GraderError("model_grader_server_error", f"judge model unavailable: {exc}") from None
    except BlockedURL as exc:
        raise GraderError("model_grader_server_error", f"judge URL refused by the SSRF guard: {exc}") from None
    if response.status_code != 200:
        raise GraderError(
            "model_grader_server_error", f"judge answered {response.status_code}: {excerpt(response.text)}"
        )
    return _reply_from_completion(response, model)


def _reply_from_completion(response: httpx.Response, requested_model: str) -> JudgeReply:
    try:
        completion = response.json()
        choice = completion["choices"][0]
        message = choice.get("message") or {}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise GraderError(
            "model_grader_server_error", f"judge answer is not a chat completion: {excerpt(response.text)}"
        ) from None
    usage = completion.get("usage") or {}
    return JudgeReply(
        content=content_text(message.get("content")),  # some servers answer with parts
        model=completion.get("model") or requested_model,
        finish_reason=choice.get("finish_reason"),
        refusal=message.get("refusal") or None,
        usage={k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
               if isinstance(usage.get(k), (int, float))},
    )


# --- local judge -----------------------------------------------------------------------------


@dataclass
class _LocalJudge:
    name: str
    model: Any
    tokenizer: Any
    lock: threading.Lock = field(default_factory=threading.Lock)  # one generation at a time


_LOAD_LOCK = threading.Lock()


def _load_local_judge(ctx: GraderContext) -> _LocalJudge:
    """Load once per context (it takes seconds to minutes); concurrent graders wait for it."""
    with _LOAD_LOCK:
        judge = ctx.shared.get("graders.local_judge")
        if judge is None or judge.name != ctx.judge_local_model:
            if message := missing_extra("worker", "a local judge model (AGENT_RFT_JUDGE_LOCAL_MODEL)", "torch",
                                        "transformers"):
                raise GraderError("model_grader_server_error", message)
            if ctx.load_judge_model is None:
                raise GraderError("model_grader_server_error", "this process cannot load a local judge model")
            model, tokenizer = ctx.load_judge_model(ctx.judge_local_model)
            model.eval()
            judge = ctx.shared["graders.local_judge"] = _LocalJudge(ctx.judge_local_model, model, tokenizer)
        return judge


def _text_only(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    flat = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise GraderError("model_grader_server_error", "the local judge model reads text only (no images or audio)")
            content = "\n".join(part["text"] for part in content)
        flat.append({"role": message["role"], "content": content})
    return flat


def _max_new_tokens(sampling: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(sampling.get(key), int) and sampling[key] > 0:
            return sampling[key]
    return LOCAL_DEFAULT_MAX_TOKENS


def _generate_locally(judge: _LocalJudge, messages: list[dict[str, str]], max_new_tokens: int) -> JudgeReply:
    import torch

    tokenizer = judge.tokenizer
    with judge.lock, torch.inference_mode():
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(judge.model.device)
        output = judge.model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    prompt_tokens = inputs["input_ids"].shape[1]
    generated = output[0, prompt_tokens:]
    ended = tokenizer.eos_token_id is not None and len(generated) > 0 and int(generated[-1]) == tokenizer.eos_token_id
    completion_tokens = len(generated)
    return JudgeReply(
        content=tokenizer.decode(generated, skip_special_tokens=True),
        model=judge.name,
        finish_reason="stop" if ended or completion_tokens < max_new_tokens else "length",
        usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": prompt_tokens + completion_tokens},
    )


async def _ask_local(messages: list[dict[str, Any]], sampling: dict[str, Any], ctx: GraderContext) -> JudgeReply:
    """Greedy generation with the model's chat template, off the event loop."""
    text_messages = _text_only(messages)
    try:
        # Queue here rather than in threads, so that waiting gradings hold no executor thread.
        async with loop_state(ctx).setdefault("local_judge_queue", asyncio.Lock()):
            judge = await asyncio.to_thread(_load_local_judge, ctx)
            return await asyncio.to_thread(_generate_locally, judge, text_messages, _max_new_tokens(sampling))
    except GraderError:
        raise
    except Exception as exc:  # noqa: BLE001 - a missing or broken model must flag, not crash the job
        raise GraderError(
            "model_grader_server_error", f"local judge '{ctx.judge_local_model}' failed: {type(exc).__name__}: {exc}"
        ) from None
