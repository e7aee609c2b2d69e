"""Serving benchmark: tokens/s and time to first token of `/v1/chat/completions` at 1, 8 and 32
concurrent clients, the unified path (the engine's continuous batching through the sampler seam,
what `agent-rft inference` runs) against the static loop it replaced (static_loop.py, frozen: the
baseline, measured in the same run on the same requests); structured outputs against free decoding
(seconds per 100 tokens); and the time to swap an evicted LoRA adapter back in.

Each server runs as its own process (benchmarks/serving/serve.py) and is called at its internal
endpoint with streaming, as the API forwards to it. Each client sends two requests one after the
other, of different lengths (16 to 96 new tokens, seeded, so both servers generate the same tokens):
a static batch runs to its longest row and a request arriving meanwhile waits for the next one,
while on the unified path a request joins the running batch at its next step.

    .venv/bin/python -m benchmarks.serving.run [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parents[1] / "results" / "serving.json"
MODEL = "SmolLM2-135M-Instruct"
TOKEN = "serving-benchmark-token"
CONCURRENCY = (1, 8, 32)
REQUESTS_PER_CLIENT = 2
# ~200 prompt tokens: a system message and a question, as the demo's agent sees them.
SYSTEM = ("You are a financial analyst. You answer questions about companies' annual reports with the figures "
          "they publish. ") * 8
# Structured outputs: a string that cannot end before 100 tokens, so both sides decode as many.
LONG_TEXT = {"type": "json_schema", "json_schema": {"name": "report", "strict": True, "schema": {
    "type": "object", "properties": {"summary": {"type": "string", "minLength": 800}}, "required": ["summary"],
    "additionalProperties": False}}}


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Company {i}: what was the revenue in 2022, and how did it change from 2021?"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(backend: str, checkpoints: Path, pool_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "AGENT_RFT_WORKER_TOKEN": TOKEN, "AGENT_RFT_INFERENCE_MODELS": MODEL,
           "AGENT_RFT_INFERENCE_POOL_SIZE": str(pool_size), "AGENT_RFT_CHECKPOINT_DIR": str(checkpoints),
           "AGENT_RFT_INFERENCE_MAX_BATCH_SIZE": "32", "AGENT_RFT_INFERENCE_MAX_QUEUE": "64"}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serving.serve", "--backend", backend, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"the {backend} inference server did not start")


def request_tokens(client: int, k: int) -> int:
    """New tokens of a client's k-th request: 16 to 96, different for neighbours."""
    return 16 + (37 * (client * REQUESTS_PER_CLIENT + k)) % 81


def body(i: int, tokens: int, checkpoint: str | None = None, *, stream: bool = True) -> dict[str, Any]:
    request = {"model": MODEL, "messages": prompt(i), "max_tokens": tokens, "temperature": 1.0, "seed": i,
               "stream": stream}
    return {"request": request, "model": {"name": MODEL, "base": MODEL, "checkpoint_path": checkpoint}}


async def one_client(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> dict[str, float]:
    started = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/internal/v1/chat/completions", json=payload) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": (first or time.perf_counter()) - started, "tokens": tokens, "total_s": time.perf_counter() - started}


async def serving_round(url: str, clients: int) -> dict[str, float]:
    """Every client sends its requests one after the other; all clients at once."""
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def client_requests(client_index: int, http: httpx.AsyncClient) -> list[dict[str, float]]:
        done = []
        for k in range(REQUESTS_PER_CLIENT):
            payload = body(client_index * REQUESTS_PER_CLIENT + k, request_tokens(client_index, k))
            payload["request"]["stream_options"] = {"include_usage": True}
            done.append(await one_client(http, url, payload))
        return done

    async with httpx.AsyncClient(headers=headers, timeout=600) as http:
        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client_requests(i, http) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {"ttft_s": statistics.median(r["ttft_s"] for r in results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


async def format_round(url: str, clients: int, response_format: dict[str, Any] | None) -> dict[str, float]:
    """`clients` requests of 100 new tokens at once, free or under `response_format`: seconds per 100 tokens."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    payloads = [body(i, 100) for i in range(clients)]
    for p in payloads:
        p["request"]["stream_options"] = {"include_usage": True}
        if response_format is not None:
            p["request"]["response_format"] = response_format
    async with httpx.AsyncClient(headers=headers, timeout=600) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(http, url, p) for p in payloads))
        wall = time.perf_counter() - started
    return {"tokens": sum(r["tokens"] for r in results), "wall_s": wall,
            "s_per_100_tokens": statistics.median(r["total_s"] / r["tokens"] * 100 for r in results)}


def make_adapters(root: Path, count: int) -> list[str]:
    """LoRA adapters of SmolLM2 as the trainer saves them (rank 16 on the attention projections)."""
    import torch

    from workers.models.loading import load_model
    from workers.models.lora import apply_lora

    paths = []
    for k in range(count):
        loaded = load_model(MODEL)
        peft_model = apply_lora(loaded, rank=16, alpha=32)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.01, generator=torch.Generator().manual_seed(k))
        path = root / f"adapter-{k}"
        peft_model.save_pretrained(str(path))
        paths.append(str(path))
    return paths


def swap_times(url: str, adapters: list[str], repeats: int) -> dict[str, float]:
    """Pool of 1: asking the other adapter evicts one and loads another; asking the same one is warm."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    warm, swapped = [], []
    with httpx.Client(headers=headers, timeout=600) as client:
        def call(path: str) -> float:
            started = time.perf_counter()
            client.post(f"{url}/internal/v1/chat/completions", json=body(0, 1, path, stream=False)).raise_for_status()
            return time.perf_counter() - started

        call(adapters[0])
        for r in range(repeats * 2):
            swapped.append(call(adapters[(r + 1) % 2]))
            warm.append(call(adapters[(r + 1) % 2]))
    return {"warm_request_s": statistics.median(warm), "swap_request_s": statistics.median(swapped),
            "swap_overhead_s": statistics.median(swapped) - statistics.median(warm)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| clients | static loop tok/s | unified tok/s | unified / static | TTFT static | TTFT unified |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['static_tokens_per_s']:.1f} | {r['unified_tokens_per_s']:.1f} | "
                     f"{r['ratio']:.2f} | {r['static_ttft_s'] * 1000:.0f} ms | {r['unified_ttft_s'] * 1000:.0f} ms |")
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| concurrent requests | free: s per 100 tokens | json_schema: s per 100 tokens | constrained / free |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['free_s_per_100']:.2f} | {r['constrained_s_per_100']:.2f} | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines)


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def compare_paths(urls: dict[str, str], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for clients in CONCURRENCY:
        runs: dict[str, list[dict[str, float]]] = {"static": [], "unified": []}
        for _ in range(repeats):  # alternated, so that both see the same noise
            for name, url in urls.items():
                runs[name].append(asyncio.run(serving_round(url, clients)))
        row: dict[str, Any] = {"clients": clients}
        for name in runs:
            row[f"{name}_tokens_per_s"] = median_of(runs[name], "tokens_per_s")
            row[f"{name}_ttft_s"] = median_of(runs[name], "ttft_s")
            row[f"{name}_runs"] = runs[name]
            row[f"{name}_tokens"] = runs[name][0]["tokens"]  # the same requests and seeds: about the same work
        row["ratio"] = row["unified_tokens_per_s"] / row["static_tokens_per_s"]
        rows.append(row)
        print(f"{clients} clients: {json.dumps({k: v for k, v in row.items() if not k.endswith('runs')})}", flush=True)
    return rows


def compare_formats(url: str, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for clients in (1, 8):
        free = [asyncio.run(format_round(url, clients, None)) for _ in range(repeats)]
        constrained = [asyncio.run(format_round(url, clients, LONG_TEXT)) for _ in range(repeats)]
        row = {"clients": clients, "free_s_per_100": median_of(free, "s_per_100_tokens"),
               "constrained_s_per_100": median_of(constrained, "s_per_100_tokens"), "free_runs": free,
               "constrained_runs": constrained}
        row["ratio"] = row["constrained_s_per_100"] / row["free_s_per_100"]
        rows.append(row)
        print(f"{clients} x 100 tokens: {json.dumps({k: v for k, v in row.items() if not k.endswith('runs')})}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from workers.models.loading import load_tokenizer
    from workers.engine.prompting import ChatFormatter

    prompt_tokens = len(ChatFormatter(load_tokenizer(MODEL)).prompt_ids(prompt(0)))
    procs = []
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp:
        adapters = make_adapters(Path(tmp), 2)
        try:
            urls = {}
            for name in ("static", "unified"):
                proc, urls[name] = start_server(name, Path(tmp), pool_size=1)
                procs.append(proc)
                asyncio.run(format_round(urls[name], 1, None))  # warm-up
            rows = compare_paths(urls, args.repeats)
            formats = compare_formats(urls["unified"], args.repeats)
            swap = swap_times(urls["unified"], adapters, args.repeats)
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = {"model": MODEL, "prompt_tokens": prompt_tokens, "requests_per_client": REQUESTS_PER_CLIENT,
           "new_tokens": [request_tokens(0, 0), "to", 96], "repeats": args.repeats, "rows": rows,
           "structured_outputs": formats, "adapter_swap": swap}
    print(table(rows))
    print(format_table(formats))
    print(f"adapter swap: warm request {swap['warm_request_s'] * 1000:.0f} ms, with a swap "
          f"{swap['swap_request_s'] * 1000:.0f} ms: {swap['swap_overhead_s'] * 1000:.0f} ms to load an evicted adapter")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
