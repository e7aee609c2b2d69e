"""The inference server (`agent-rft inference`): a process of its own, torch inside, no database.

The API authenticates the caller, resolves the model name within the caller's project and
forwards `{"request": <checked chat request>, "model": {"name", "base", "checkpoint_path"}}` to
`POST /internal/v1/chat/completions` with the worker token. Answers are OpenAI's chat-completion
objects, or server-sent `chat.completion.chunk` events when `stream` is true.

A request that finds `AGENT_RFT_INFERENCE_MAX_QUEUE` requests already waiting is answered 429
`rate_limit_exceeded` with `Retry-After` at once (before any stream starts), as OpenAI answers a
request it has no capacity for; the API passes both through.

What generates is the backend of `AGENT_RFT_INFERENCE_BACKEND` (workers/inference/backend.py):
the engine's continuous batching on the models this process loads, or the vLLM fleet of
`AGENT_RFT_VLLM_URLS`, both through the sampler seam the rollout engine samples through. Either way
the prompt is rendered and the answer read here, by the rollout engine's own formatter and
tool-call parser. With the vLLM backend this process imports no torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from app.core.bearer import bearer_token, same_secret
from app.core.config import Settings
from app.core.errors import error_body
from app.observability.access import metrics_refusal
from workers.inference import metrics
from workers.inference.backend import GenerationBackend, Pending, QueueFull
from workers.inference.chat import BadChatRequest, ChatPlan, chunk, completion_body, delta, tool_call_deltas, usage
from workers.inference.served import ModelUnavailable

log = logging.getLogger(__name__)


def _error(status: int, message: str, *, code: str, param: str | None = None,
           type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type=type, code=code, param=param), status_code=status, headers=headers)


def _queue_full(exc: QueueFull) -> JSONResponse:
    # OpenAI's 429 for "too many requests right now" is code rate_limit_exceeded, type "requests";
    # the SDKs retry it after Retry-After.
    return _error(429, f"The inference server is at capacity: {exc.waiting} requests are already waiting for "
                       f"generation. Please try again in {exc.retry_after_s} s.",
                  code="rate_limit_exceeded", type="requests", headers={"Retry-After": str(exc.retry_after_s)})


def _error_for(exc: BaseException) -> JSONResponse:
    if isinstance(exc, BadChatRequest):
        return _error(400, exc.message, code=exc.code, param=exc.param)
    if isinstance(exc, ModelUnavailable):
        return _error(exc.status, exc.message, code=exc.code, param="model",
                      type="server_error" if exc.status >= 500 else "invalid_request_error")
    return _error(500, f"Generation failed: {type(exc).__name__}", code="generation_failed", type="server_error")


def generation_backend(settings: Settings, *, preload: bool = True) -> GenerationBackend:
    """The backend AGENT_RFT_INFERENCE_BACKEND names; `preload`: load (or check) every base model
    before the server says it is ready."""
    if settings.inference_backend == "vllm":
        from workers.inference.vllm_backend import VLLMBackend

        return VLLMBackend(settings)
    from workers.inference.engine_backend import EngineBackend  # torch: only where the engine generates
    from workers.inference.pool import ModelPool

    pool = ModelPool(bases=settings.inference_models, capacity=settings.inference_pool_size,
                     dtype=settings.inference_dtype, checkpoint_root=settings.resolved_checkpoint_dir)
    return EngineBackend(pool, max_batch_size=settings.inference_max_batch_size,
                         default_max_tokens=settings.inference_default_max_tokens,
                         max_waiting=settings.inference_max_queue,
                         preload=settings.inference_models if preload else [])


def create_inference_app(settings: Settings, *, preload: bool = True,
                         backend: GenerationBackend | None = None) -> FastAPI:
    """The inference server's app; `backend`: what generates (default: AGENT_RFT_INFERENCE_BACKEND's)."""
    backend = backend or generation_backend(settings, preload=preload)
    token = settings.worker_token.get_secret_value()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        await backend.start()
        yield
        await backend.stop()

    app = FastAPI(title="agent-rft inference", lifespan=lifespan)
    app.state.backend = backend

    def authorized(request: Request) -> bool:
        return same_secret(bearer_token(request.headers.get("authorization")), token)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", **backend.health()}

    @app.get("/metrics", include_in_schema=False)
    def metrics_page(request: Request) -> Response:
        refusal = metrics_refusal(settings, authorization=request.headers.get("authorization"),
                                  client_host=request.client.host if request.client else None)
        if refusal is not None:
            return _error(refusal.status_code, refusal.message, code=refusal.code or "", headers=refusal.headers)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/internal/v1/chat/completions", response_model=None)
    async def complete(request: Request) -> Response:
        response = await answer(request)
        metrics.record_request(response.status_code)  # a stream counts as answered once it starts
        return response

    async def answer(request: Request) -> Response:
        if not authorized(request):
            return _error(401, "The inference server needs the worker token.", code="invalid_worker_token")
        try:
            body = await request.json()
        except ValueError:
            body = None
        chat_request, model = (body.get("request"), body.get("model")) if isinstance(body, dict) else (None, None)
        if not isinstance(chat_request, dict) or not isinstance(model, dict) or not {"name", "base"} <= set(model):
            return _error(400, "Expected {'request': {...}, 'model': {'name', 'base', 'checkpoint_path'}}.",
                          code="invalid_value")
        pending = Pending(chat_request, model, stream=bool(chat_request.get("stream")))
        try:
            backend.submit(pending)
        except QueueFull as exc:
            return _queue_full(exc)
        first = await pending.events.get()
        if first[0] == "error":
            return _error_for(first[1])
        chat: ChatPlan = first[1]
        if pending.stream:
            return StreamingResponse(_events(pending, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        event = await pending.events.get()
        if event[0] == "error":
            return _error_for(event[1])
        choices = [result for _, result in event[2]]
        metrics.record_generation(pending, usage(chat, choices)["completion_tokens"])
        return JSONResponse(completion_body(chat, choices))

    return app


async def _events(pending: Pending, chat: ChatPlan) -> AsyncIterator[str]:
    """OpenAI's stream: a role delta per choice, content deltas, tool-call deltas, a finish chunk per
    choice, the usage chunk when asked for, then [DONE]."""
    choices = range(len(chat.generations))
    yield chunk(chat, [delta(i, role="assistant", content="") for i in choices])
    while True:
        event = await pending.events.get()
        if event[0] == "delta":
            yield chunk(chat, [delta(event[1], content=event[2])])
            continue
        if event[0] == "error":
            response = _error_for(event[1])
            yield f"data: {response.body.decode()}\n\n"
            return
        break
    finished = event[2]
    metrics.record_generation(pending, usage(chat, [result for _, result in finished])["completion_tokens"])
    for entry, result in finished:
        rest = entry.stream.rest(result) if entry.stream else ""
        if rest:
            yield chunk(chat, [delta(result.index, content=rest)])
        if result.tool_calls:
            yield chunk(chat, [delta(result.index, tool_calls=tool_call_deltas(result.tool_calls))])
        yield chunk(chat, [delta(result.index, finish=result.finish)])
    if (chat.request.get("stream_options") or {}).get("include_usage"):
        yield chunk(chat, [], usage_block=usage(chat, [result for _, result in finished]))
    yield "data: [DONE]\n\n"
