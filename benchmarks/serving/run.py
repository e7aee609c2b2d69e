"""Serving benchmark: time to first token and tokens/s of `/v1/chat/completions` at 1, 4 and 16
concurrent clients, against the training engine's own throughput on the same batch (the ratio is
the figure), and the time to swap an evicted LoRA adapter back in.

The inference server runs as its own process (`agent-rft inference`, as deployed) and is called at
its internal endpoint with streaming, as the API forwards to it; the engine baseline is
`generate_batch` on the same model, prompts and token counts, in this process, measured in the
same run with the server idle. Both share the same cores, one after the other.

    .venv/bin/python -m benchmarks.serving.run [--repeats 3] [--tokens 48]
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
CONCURRENCY = (1, 4, 16)
# ~300 prompt tokens: a system message and a question, as the demo's agent sees them.
SYSTEM = ("You are a financial analyst. You answer questions about companies' annual reports with the figures "
          "they publish. ") * 8


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Company {i}: what was the revenue in 2022, and how did it change from 2021?"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(checkpoints: Path, pool_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "AGENT_RFT_WORKER_TOKEN": TOKEN, "AGENT_RFT_INFERENCE_MODELS": MODEL,
           "AGENT_RFT_INFERENCE_POOL_SIZE": str(pool_size), "AGENT_RFT_CHECKPOINT_DIR": str(checkpoints),
           "AGENT_RFT_INFERENCE_MAX_BATCH_SIZE": "16"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "agent-rft"), "inference", "--port", str(port)],
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
    raise SystemExit("the inference server did not start")


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


async def serving_round(url: str, clients: int, tokens: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        started = time.perf_counter()
        payloads = [body(i, tokens) for i in range(clients)]
        for p in payloads:
            p["request"]["stream_options"] = {"include_usage": True}
        results = await asyncio.gather(*(one_client(client, url, p) for p in payloads))
        wall = time.perf_counter() - started
    return {"ttft_s": statistics.median(r["ttft_s"] for r in results), "tokens": sum(r["tokens"] for r in results),
            "wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall}


def engine_round(loaded: Any, formatter: Any, clients: int, tokens: int) -> dict[str, float]:
    """The training engine's generation of the same batch: same prompts, seeds and token counts."""
    from workers.rl.generation import GenerationRequest, generate_batch
    from workers.rl.models import sampling_weights

    requests = [GenerationRequest(context_ids=formatter.prompt_ids(prompt(i)), max_new_tokens=tokens, seed=i,
                                  stop_token_ids=formatter.stop_token_ids()) for i in range(clients)]
    pad = loaded.tokenizer.pad_token_id
    started = time.perf_counter()
    with sampling_weights(loaded.model):  # as the rollout engine and the server sample (their preparation timed)
        outputs = generate_batch(loaded.model, requests, pad_token_id=pad, temperature=1.0, decode=formatter.decode)
    wall = time.perf_counter() - started
    produced = sum(len(o.token_ids) for o in outputs)
    return {"tokens": produced, "wall_s": wall, "tokens_per_s": produced / wall}


def make_adapters(root: Path, count: int) -> list[str]:
    """LoRA adapters of SmolLM2 as the trainer saves them (rank 16 on the attention projections)."""
    import torch

    from workers.rl.models import apply_lora, load_model

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
    lines = ["| clients | TTFT (median) | serving tok/s | engine tok/s (same batch) | serving / engine |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['ttft_s'] * 1000:.0f} ms | {r['serving_tokens_per_s']:.1f} | "
                     f"{r['engine_tokens_per_s']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()

    from workers.rl.models import load_model
    from workers.rl.prompting import ChatFormatter

    loaded = load_model(MODEL)
    formatter = ChatFormatter(loaded.tokenizer)
    prompt_tokens = len(formatter.prompt_ids(prompt(0)))
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp:
        adapters = make_adapters(Path(tmp), 2)
        proc, url = start_server(Path(tmp), pool_size=1)
        try:
            asyncio.run(serving_round(url, 1, 4))  # warm-up
            rows = []
            for clients in CONCURRENCY:
                serving = [asyncio.run(serving_round(url, clients, args.tokens)) for _ in range(args.repeats)]
                engine = [engine_round(loaded, formatter, clients, args.tokens) for _ in range(args.repeats)]
                row = {"clients": clients,
                       "ttft_s": statistics.median(s["ttft_s"] for s in serving),
                       "serving_tokens_per_s": statistics.median(s["tokens_per_s"] for s in serving),
                       "engine_tokens_per_s": statistics.median(e["tokens_per_s"] for e in engine),
                       "serving_runs": serving, "engine_runs": engine}
                row["ratio"] = row["serving_tokens_per_s"] / row["engine_tokens_per_s"]
                rows.append(row)
                print(f"{clients} clients: {json.dumps({k: v for k, v in row.items() if not k.endswith('runs')})}",
                      flush=True)
            swap = swap_times(url, adapters, args.repeats)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = {"model": MODEL, "prompt_tokens": prompt_tokens, "new_tokens": args.tokens, "repeats": args.repeats,
           "torch_threads": __import__("torch").get_num_threads(), "rows": rows, "adapter_swap": swap}
    print(table(rows))
    print(f"adapter swap: warm request {swap['warm_request_s'] * 1000:.0f} ms, with a swap "
          f"{swap['swap_request_s'] * 1000:.0f} ms: {swap['swap_overhead_s'] * 1000:.0f} ms to load an evicted adapter")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
