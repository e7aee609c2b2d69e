"""Input limits every request meets before it is routed (docs/security.md, "Input limits").

- No NUL character (U+0000) in the path, the query, a form field or a JSON string or key:
  PostgreSQL's text and JSONB columns cannot hold one, and psycopg refused it as a 500.
- No unpaired surrogate (a `\\ud800` escape with no partner) in a JSON string or key: it is not
  Unicode, so it cannot be encoded as UTF-8 for PostgreSQL, a tokenizer or an answer.
- JSON nested at most MAX_JSON_DEPTH levels: deeper, Python's parser and every recursive walk
  after it run out of stack.

One ASGI middleware (`InputLimits`, installed by app.main.create_app) answers both with a 400 in
OpenAI's error shape, before any route runs. Multipart bodies (file uploads) pass through
unread: app/jobs/validation.py checks a file's lines with `json_problem`, line by line. The
worker API's bodies and a chat completion's `messages` may hold a NUL (UNCHECKED_BODIES,
NUL_ALLOWED: they are stored made storable, or never stored); no body may hold a surrogate
except the worker API's, which app.core.db.storable_json replaces."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.db import SURROGATE
from app.core.errors import encodable, error_body

MAX_JSON_DEPTH = 64
NUL = "\x00"
# Bodies left as they are. The worker API (/internal/v1, behind the worker token) stores what a
# worker pushes through app.core.db.storable_json, NUL as U+FFFD: a rollout whose model decoded
# a NUL is kept, not refused. Its paths and queries are still checked.
UNCHECKED_BODIES = ("/internal/",)
# Top-level fields whose strings may hold a NUL because they never reach the database: a chat
# completion's conversation (a tool's output, say) goes only to the inference server.
NUL_ALLOWED: dict[str, frozenset[str]] = {"/v1/chat/completions": frozenset({"messages"})}
NUL_MESSAGE = "contains a NUL character (\\u0000), which is not accepted"
SURROGATE_MESSAGE = "contains an unpaired surrogate (a \\ud800-\\udfff escape without its partner), which is not valid Unicode"
# How a surrogate reaches a parsed string: a \uD800-\uDFFF escape, or UTF-16/32 JSON (json.loads
# decodes it keeping unpaired surrogates; its ASCII characters carry zero bytes).
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\x00")
_FORM = "application/x-www-form-urlencoded"


def printable(name: str) -> str:
    """A parameter's name as it can be shown (and encoded): a NUL or a surrogate in it spelled \\uXXXX."""
    return encodable(name.replace(NUL, "\\u0000"))


def text_problem(value: str, *, nul: bool = True) -> str | None:
    """'nul' or 'surrogate' for a string that cannot be stored or encoded (a NUL only when `nul`), else None."""
    if nul and NUL in value:
        return "nul"
    return "surrogate" if SURROGATE.search(value) else None


def _trail_param(trail: Any) -> str:
    """The field path of a (key, parent trail) chain: 'method.reinforcement.tools[0].name'."""
    parts: list[Any] = []
    while trail is not None:
        key, trail = trail
        parts.append(key)
    param = ""
    for part in reversed(parts):
        param += f"[{part}]" if isinstance(part, int) else ("." if param else "") + printable(part)
    return param


def json_problem(value: Any, *, max_depth: int = MAX_JSON_DEPTH, nul: bool = True, surrogates: bool = True,
                 nul_allowed: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """The first problem of a parsed JSON value, in document order: ('too_deep', field path) for a
    container more than `max_depth` levels deep; ('nul', field path) for a string or key with a NUL
    (when `nul`; not below the top-level keys `nul_allowed`); ('surrogate', field path) for one with
    an unpaired surrogate (when `surrogates`); else None. Iterative, so it walks any depth the
    parser returned."""
    def problem_of(text: str, refuse_nul: bool) -> str | None:
        return text_problem(text, nul=refuse_nul) if surrogates else ("nul" if refuse_nul and NUL in text else None)

    # (node, trail, depth, NULs are refused here)
    stack: list[tuple[Any, Any, int, bool]] = [(value, None, 1, nul)]
    look = nul or surrogates
    while stack:
        node, trail, depth, refuse_nul = stack.pop()
        if isinstance(node, str):
            if look and (kind := problem_of(node, refuse_nul)) is not None:
                return kind, _trail_param(trail)
            continue
        if not isinstance(node, (dict, list)):
            continue  # a number, a boolean or null at the root
        if depth > max_depth:
            return "too_deep", _trail_param(trail)
        children: Iterator[tuple[Any, Any]] = iter(node.items()) if isinstance(node, dict) else enumerate(node)
        pushed = []
        for key, child in children:
            if look and isinstance(key, str) and (kind := problem_of(key, refuse_nul)) is not None:
                return kind, _trail_param((key, trail))
            child_refuses_nul = refuse_nul and not (trail is None and key in nul_allowed)
            if isinstance(child, (dict, list)) or (look and isinstance(child, str)):
                pushed.append((child, (key, trail), depth + 1, child_refuses_nul))
        stack.extend(reversed(pushed))
    return None


def worth_walking(raw: bytes) -> tuple[bool, bool, bool]:
    """(walk the parsed value?, look for NULs?, look for surrogates?) for raw JSON. Only an escape
    puts a NUL or a surrogate in a parsed UTF-8 string (raw, neither is JSON; a raw zero byte may be
    UTF-16 or UTF-32, which json.loads also reads), and a text with at most MAX_JSON_DEPTH brackets
    cannot nest deeper: most bodies and rows are never walked."""
    nul = b"\\u0000" in raw or b"\x00" in raw
    surrogates = _SURROGATE_SOURCE.search(raw) is not None
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    return nul or surrogates or deep, nul, surrogates


PROBLEM_MESSAGES = {"nul": NUL_MESSAGE, "surrogate": SURROGATE_MESSAGE}


def _refusal(message: str, *, param: str, code: str = "invalid_value") -> JSONResponse:
    return JSONResponse(error_body(message, type="invalid_request_error", code=code, param=param), status_code=400)


def _text_refusal(param: str, kind: str = "nul") -> JSONResponse:
    return _refusal(f"Invalid value for '{param}': it {PROBLEM_MESSAGES[kind]}.", param=param)


def _too_deep() -> JSONResponse:
    return _refusal(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.", param="body",
                    code="too_deep")


def _routes(routes: Any) -> Iterator[Any]:
    """Every route with a path regex; FastAPI (0.16x) keeps an included router's routes, whose paths
    carry the router's prefix, behind `original_router`."""
    for route in routes:
        if hasattr(route, "path_regex"):
            yield route
        elif (included := getattr(route, "original_router", None)) is not None:
            yield from _routes(included.routes)


def _path_param(scope: Scope) -> str:
    """The name of the path parameter that holds the NUL (the first route whose path matches), else 'path'."""
    for route in _routes(getattr(scope.get("app"), "routes", ())):
        match = route.path_regex.match(scope["path"])
        if match is not None:
            return next((name for name, value in match.groupdict().items() if NUL in value), "path")
    return "path"


def _pairs_problem(pairs: list[tuple[str, str]]) -> str | None:
    """The name of the first query or form field whose name or value has a NUL."""
    return next((printable(name) for name, value in pairs if NUL in name or NUL in value), None)


def _query_problem(raw: bytes) -> str | None:
    if b"%00" not in raw and b"\x00" not in raw:
        return None
    return _pairs_problem(parse_qsl(raw.decode("latin-1"), keep_blank_values=True))


def _body_kind(scope: Scope) -> str | None:
    """'json' (what FastAPI parses as JSON: no content type, application/json, */*+json), 'form',
    or None for a body this middleware leaves alone (none, multipart, anything else)."""
    headers = dict(scope["headers"])
    if not headers.get(b"content-length", b"0").strip(b"0 ") and b"transfer-encoding" not in headers:
        return None  # no body
    content_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
    if content_type == _FORM:
        return "form"
    main, _, sub = content_type.partition("/")
    if not content_type or (main == "application" and (sub == "json" or sub.endswith("+json"))):
        return "json"
    return None


def _json_body_problem(body: bytes, *, nul_allowed: frozenset[str]) -> JSONResponse | None:
    walk, has_nul, has_surrogates = worth_walking(body)
    if not walk:
        return None
    try:
        value = json.loads(body)
    except RecursionError:
        return _too_deep()
    except ValueError:
        return None  # not JSON: the route answers it as it always has
    problem = json_problem(value, nul=has_nul, surrogates=has_surrogates, nul_allowed=nul_allowed)
    if problem is None:
        return None
    kind, param = problem
    return _too_deep() if kind == "too_deep" else _text_refusal(param or "body", kind)


async def _read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    chunks, messages = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


class InputLimits:
    """Answer 400 to a request with a NUL in its path, query, form or JSON body, or with a JSON body
    nested deeper than MAX_JSON_DEPTH; pass every other request on untouched (the JSON or form body
    it had to read is replayed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = None
        if NUL in scope["path"]:
            refusal = _text_refusal(_path_param(scope))
        elif (name := _query_problem(scope.get("query_string", b""))) is not None:
            refusal = _text_refusal(name)
        elif not scope["path"].startswith(UNCHECKED_BODIES) and (kind := _body_kind(scope)) is not None:
            body, messages = await _read_body(receive)
            if kind == "json":
                refusal = _json_body_problem(body, nul_allowed=NUL_ALLOWED.get(scope["path"].rstrip("/"), frozenset()))
            elif (name := _query_problem(body)) is not None:
                refusal = _text_refusal(name)
            receive = _replay(messages, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that hands out the messages already read, then reads on (a disconnect, say)."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
