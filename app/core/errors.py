"""Every error leaves the API in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_rft.schema_tags import UNION_TAGS

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        self.headers = headers


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def not_found(kind: str, object_id: str, *, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind}: '{object_id}'", code=f"{kind.replace(' ', '_').replace('-', '_')}_not_found", param=param)


def conflict(message: str, *, code: str = "conflict", param: str | None = None) -> APIError:
    return APIError(409, message, code=code, param=param)


def encodable(text: str) -> str:
    """`text` with any unpaired surrogate spelled as its escape (\\ud800): an answer must encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, *, type: str, code: str | None, param: str | None) -> dict[str, Any]:
    """OpenAI's error object; a message or param that quotes the request's bad text stays encodable."""
    return {"error": {"message": encodable(message), "type": type,
                      "param": encodable(param) if param is not None else None, "code": code}}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'method', 'reinforcement', 'tools', 0, 'name') -> 'method.reinforcement.tools[0].name'."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header", "form")]
    parts = [p for p in parts if p not in UNION_TAGS]
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and "[" not in part and "(" not in part:
            param += ("." if param else "") + part
    return param or None


def _validation_message(err: dict[str, Any], param: str | None) -> str:
    msg = err.get("msg", "Invalid value").removeprefix("Value error, ")
    return f"Invalid value for '{param}': {msg}" if param else msg


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, type=exc.type, code=exc.code, param=exc.param),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "Invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
        message = _validation_message(first, param)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        return JSONResponse(
            error_body(message, type="invalid_request_error", code=code, param=param), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), type="invalid_request_error", code=code, param=None),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            error_body("The server had an error while processing your request.", type="server_error", code="internal_error", param=None),
            status_code=500,
        )
