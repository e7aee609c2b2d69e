"""The API's side of the inference server: forward a checked chat request, stream the answer through.

The inference server (`agent-rft inference`, workers/inference/) is trusted like a worker: it is
called with the worker token. Every wait has a timeout; an unreachable, crashed or stuck inference
server is a 503 `inference_unavailable` with a clear message, never a hang or a 500. Its 429
(a full queue) reaches the caller as it is, `Retry-After` included, so that clients back off.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.core.config import Settings
from app.core.errors import APIError, error_body

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
COMPLETIONS_PATH = "/internal/v1/chat/completions"
RELAYED_HEADERS = ("retry-after",)  # of the inference server's answer, the headers the caller needs


RETRY_UNAVAILABLE_S = 5  # the Retry-After of a 503 for an inference server that did not answer


def unavailable(settings: Settings, detail: str) -> APIError:
    return APIError(503, f"The inference server ({settings.inference_url}) is unavailable: {detail}. Start it with "
                         "`agent-rft inference` (docs/serving.md), or try again.",
                    code="inference_unavailable", type="server_error",
                    headers={"Retry-After": str(RETRY_UNAVAILABLE_S)})


class InferenceClient:
    """One connection pool to the inference server, shared by the API's requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        timeout = httpx.Timeout(settings.inference_timeout_s, connect=min(CONNECT_TIMEOUT_S, settings.inference_timeout_s))
        self.http = httpx.AsyncClient(
            base_url=settings.inference_url.rstrip("/"), timeout=timeout,
            headers={"Authorization": f"Bearer {settings.worker_token.get_secret_value()}"},
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def complete(self, body: dict[str, Any], model: dict[str, Any]) -> Response:
        """Non-streaming: the inference server's JSON answer (success or OpenAI-shaped error) as is."""
        answer = await self._post(body, model)
        return _relay(self.settings, answer.status_code, answer.content, answer.headers)

    async def completion(self, body: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
        """Non-streaming, for a route that answers in another shape: the chat completion; the
        inference server's error (429 with its Retry-After, 4xx) raised as the APIError it answered."""
        answer = await self._post(body, model)
        relayed = _relay(self.settings, answer.status_code, answer.content, answer.headers)
        if answer.status_code != 200:
            raise _as_error(relayed)
        return json.loads(relayed.body)

    async def _post(self, body: dict[str, Any], model: dict[str, Any]) -> httpx.Response:
        try:
            return await self.http.post(COMPLETIONS_PATH, json={"request": body, "model": model})
        except httpx.TimeoutException as exc:
            raise unavailable(self.settings, f"no answer within {self.settings.inference_timeout_s:.0f} s") from exc
        except httpx.HTTPError as exc:
            raise unavailable(self.settings, _describe(exc)) from exc

    async def stream(self, body: dict[str, Any], model: dict[str, Any]) -> Response:
        """Streaming: waits for the inference server to accept the request (so a bad request is
        still a plain 4xx), then relays its server-sent events as they come."""
        answer = await self._open_stream(body, model)
        if isinstance(answer, Response):
            return answer
        return StreamingResponse(self._relay_events(answer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def chunks(self, body: dict[str, Any], model: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streaming, for a route that answers in another shape: waits for the inference server to
        accept the request (its refusal raised as an APIError), then yields each chat completion
        chunk as it comes."""
        answer = await self._open_stream(body, model)
        if isinstance(answer, Response):
            raise _as_error(answer)
        return self._parsed_events(answer)

    async def _parsed_events(self, answer: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in answer.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                if data and data != "[DONE]":
                    yield json.loads(data)
        except httpx.HTTPError as exc:
            raise unavailable(self.settings, f"the stream broke off ({_describe(exc)})") from exc
        finally:
            await answer.aclose()

    async def _open_stream(self, body: dict[str, Any], model: dict[str, Any]) -> httpx.Response | Response:
        """The accepted stream, or the inference server's refusal relayed as a response."""
        request = self.http.build_request("POST", COMPLETIONS_PATH, json={"request": body, "model": model})
        try:
            answer = await self.http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise unavailable(self.settings, f"no answer within {self.settings.inference_timeout_s:.0f} s") from exc
        except httpx.HTTPError as exc:
            raise unavailable(self.settings, _describe(exc)) from exc
        if answer.status_code == 200:
            return answer
        try:
            content = await answer.aread()
        except httpx.HTTPError as exc:
            raise unavailable(self.settings, _describe(exc)) from exc
        finally:
            await answer.aclose()
        return _relay(self.settings, answer.status_code, content, answer.headers)

    async def _relay_events(self, answer: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            # Headers are sent: the failure can only be told in the stream, as OpenAI does.
            error = unavailable(self.settings, f"the stream broke off ({_describe(exc)})")
            payload = error_body(error.message, type=error.type, code=error.code, param=None)
            yield f"data: {json.dumps(payload)}\n\n".encode()
        finally:
            await answer.aclose()


def _relay(settings: Settings, status: int, content: bytes, headers: httpx.Headers) -> Response:
    if status >= 500 and status != 503:
        log.warning("inference server answered %s: %s", status, content[:500])
        raise unavailable(settings, f"it answered HTTP {status}")
    try:
        payload = json.loads(content)
    except ValueError as exc:
        raise unavailable(settings, f"it answered HTTP {status} with a body that is not JSON") from exc
    return JSONResponse(payload, status_code=status, headers=_relayed_headers(headers))


def _as_error(relayed: Response) -> APIError:
    """The inference server's error answer (OpenAI's shape, relayed) as the APIError to raise."""
    error = json.loads(relayed.body).get("error") or {}
    retry_after = relayed.headers.get("retry-after")
    return APIError(relayed.status_code, error.get("message") or "The inference server refused the request.",
                    code=error.get("code"), param=error.get("param"), type=error.get("type") or "server_error",
                    headers={"Retry-After": retry_after} if retry_after else None)


def _relayed_headers(headers: httpx.Headers) -> dict[str, str]:
    return {name: headers[name] for name in RELAYED_HEADERS if name in headers}


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
