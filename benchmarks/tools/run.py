"""Tool backpressure and the tool-result cache on one GRPO step.

A step of 8 prompts x 8 rollouts (64 rollouts, the 8 of a prompt share its questions, as a GRPO
group does) against a local `search` tool that answers after 100 ms and allows 20 requests/s: a
request over the limit (a sliding one-second window of accepted requests) answers 429 with
`Retry-After` = the seconds until the window frees (an integer, rounded up, as RFC 9110
delta-seconds are; `--fractional-retry-after` sends the exact value). Each rollout makes 3 search
calls, one per turn, then answers; the queries repeat within a group: the first is the same for
all 8 rollouts, the second one of 2 variants, the third one of 4 (7 distinct calls per group, 56
of the step's 192).

Configurations, each a child process that imports workers/ and app/ from one tree:
  (a) baseline: commit BASELINE_REV's tool client (today's behaviour: a 429 is a retried failure,
      3 retries with backoff, then the rollout is dropped as a tool failure; no cache), from a
      temporary git worktree first on sys.path;
  (b) this checkout, backpressure only (the tool entry has no cache): 429 + Retry-After is waited
      out without spending a retry, and the tool's concurrency halves (AIMD);
  (c) this checkout, backpressure + `read_only: true, cache: true`.
and a reference: this checkout, no cache, against the same tool without its rate limit (what the
step costs here when the tool never throttles: the scripted engine's own time plus 3 x 100 ms).
Every configuration runs `--repeats` times (alternating a, b, c, reference); the table gives medians of the
step's wall time, requests that reached the endpoint (counted at the server), 429s it answered,
rollouts kept (not tool_failure) and tool failures.

What the comparison leaves out: model compute (the policy is scripted: it forces the tokens of its
script through the tiny model's tokenizer, `tiny-smollm2`, with no forward pass of a real model;
the engine still samples every token over the 49k-token vocabulary, which on a small, shared CPU
costs about as much as the tool path: see the reference column, so step times are close and noisy
there and the endpoint counts are the robust result), grading and
the update (only the sampling half of a step), network latency beyond 127.0.0.1, a server whose
limit is shared with other clients, and tools other than one search; every rollout follows the same
script, so the calls arrive in lockstep bursts (the worst case for a rate limit).

    .venv/bin/python -m benchmarks.tools.run [--repeats 3] [--fractional-retry-after]

Prints a table and writes benchmarks/results/tools.json (tools_fractional_retry_after.json with
the flag). The medians are per measure, so a column's parts need not add up; step times move by
a few seconds from run to run (the scripted engine's own time is part of every step).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

from fastapi import Request  # module level: the handler's annotation is resolved from these globals

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "tools.json"
BASELINE_REV = "be701d8"  # the last commit before tool backpressure and the cache
PROMPTS, GROUP, CALLS = 8, 8, 3
LATENCY_S, RATE_PER_S = 0.1, 20
CONFIGS = {  # name -> (tree: "baseline" or "new", extra fields of the tool's entry, rate-limited server)
    "a_baseline": ("baseline", {}, True),
    "b_backpressure": ("new", {}, True),
    "c_backpressure_cache": ("new", {"read_only": True, "cache": True}, True),
    "ref_no_limit": ("new", {}, False),
}
SCRIPT_MARK = re.compile(r"SCRIPT=p(\d+)r(\d+)")


# --- the tool server (the parent process) ---------------------------------------------------------

class SearchServer:
    """`search` after LATENCY_S, at most RATE_PER_S accepted requests in any second; counts requests."""

    def __init__(self, *, fractional_retry_after: bool) -> None:
        self.fractional = fractional_retry_after
        self.limited = True  # False: the reference run, no rate limit
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.accepted: collections.deque[float] = collections.deque()
            self.requests = self.served = self.throttled = 0
            self.busiest_second = 0

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"requests": self.requests, "served": self.served, "answered_429": self.throttled}

    def app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse

        app = FastAPI()

        @app.post("/tools")
        async def tools(request: Request) -> Any:
            call = await request.json()
            now = time.monotonic()
            with self.lock:
                self.requests += 1
                while self.accepted and self.accepted[0] <= now - 1.0:
                    self.accepted.popleft()
                if self.limited and len(self.accepted) >= RATE_PER_S:
                    self.throttled += 1
                    wait = self.accepted[0] + 1.0 - now
                    value = f"{wait:.3f}" if self.fractional else str(max(1, math.ceil(wait)))
                    return PlainTextResponse(f"rate limit: {RATE_PER_S} requests/s", status_code=429,
                                             headers={"Retry-After": value})
                self.accepted.append(now)
            await asyncio.sleep(LATENCY_S)
            query = json.loads(call["arguments"]).get("query", "")
            with self.lock:
                self.served += 1
            return JSONResponse({"type": "function_call_output", "call_id": call["call_id"],
                                 "output": f"3 results for {query!r}: report-1, report-2, report-3"})

        return app


@contextmanager
def serve(app: Any) -> Iterator[int]:
    """The app under uvicorn on 127.0.0.1, in a thread (as tests/conftest.py serve_app); yields its port."""
    import socket

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the tool server did not start")
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# --- one step (a child process, with one tree first on sys.path) --------------------------------

def queries(prompt: int, rollout: int) -> list[str]:
    """The rollout's 3 queries: shared by the group, one of 2, one of 4."""
    return [f"company {prompt} revenue", f"company {prompt} annual report v{rollout % 2}",
            f"company {prompt} net income source {rollout % 4}"]


def make_policy(tokenizer: Any) -> Any:
    """A stand-in for the model that puts all probability on the next token of the rollout's script
    (the idea of tests/rl/policies.py ScriptedPolicy): the engine does everything else for real."""
    import torch

    class ScriptedPolicy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(max_position_embeddings=8192)
            self._anchor = torch.nn.Parameter(torch.zeros(1))  # the engine asks for the device
            self.header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
            self.vocab = len(tokenizer)
            self.targets: dict[tuple[int, int, int], list[int]] = {}
            self.marks: dict[tuple[int, ...], tuple[int, int]] = {}

        def _target(self, row: list[int]) -> tuple[list[int], int]:
            first, size = self.header[0], len(self.header)
            starts = [i for i, token in enumerate(row) if token == first and row[i:i + size] == self.header]
            prefix = tuple(row[:starts[0]])
            if prefix not in self.marks:
                self.marks[prefix] = tuple(map(int, SCRIPT_MARK.search(tokenizer.decode(prefix)).groups()))
            prompt, rollout = self.marks[prefix]
            turn = min(len(starts) - 1, CALLS)
            key = (prompt, rollout, turn)
            if key not in self.targets:
                text = (f'<tool_call>{json.dumps({"name": "search", "arguments": {"query": queries(prompt, rollout)[turn]}})}'
                        "</tool_call>" if turn < CALLS else f"Company {prompt} earned 412.5 million.")
                self.targets[key] = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
            return self.targets[key], len(row) - starts[-1] - len(self.header)

        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **_):  # noqa: ANN001, ANN201
            from transformers import DynamicCache

            # The cache's "keys" are the token ids, so each row's context is read back from it.
            cache = cache if cache is not None else DynamicCache()
            as_keys = input_ids.float()[:, None, :, None]
            keys, _ = cache.update(as_keys, as_keys, 0)
            logits = torch.full((len(input_ids), 1, self.vocab), -1e4)
            for i, (row_keys, mask) in enumerate(zip(keys[:, 0, :, 0], attention_mask)):
                target, done = self._target(row_keys[mask.bool()].long().tolist())
                logits[i, 0, target[done] if done < len(target) else tokenizer.eos_token_id] = 1e4
            return SimpleNamespace(logits=logits, cache=cache)

    return ScriptedPolicy()


def child(tree: Path, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    from workers.engine import tools_client
    from workers.models.loading import load_model
    from workers.engine.prompting import ChatFormatter
    from workers.engine.rollout import EngineConfig, RolloutEngine, RolloutSpec
    from workers.engine.toolcalls import ToolSchema

    source = Path(tools_client.__file__).resolve()
    assert source.is_relative_to(tree.resolve()), f"{source} is not from {tree}"
    tokenizer = load_model("tiny-smollm2").tokenizer
    tools = [ToolSchema("search", "Search the reports",
                        {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})]
    specs = [RolloutSpec(sample_index=p * GROUP + r, tools=tools, item={"question": p}, seed=p * GROUP + r,
                         messages=[{"role": "user", "content": f"What did company {p} earn? SCRIPT=p{p}r{r}"}])
             for p in range(PROMPTS) for r in range(GROUP)]
    endpoint = {"name": "search", "server_url": url, **extra}

    async def step() -> tuple[float, list[Any], Any]:
        async with tools_client.ToolClient([endpoint], allowlist=["127.0.0.1"]) as client:
            engine = RolloutEngine(make_policy(tokenizer), tokenizer, ChatFormatter(tokenizer), client,
                                   EngineConfig(max_episode_steps=10))
            started = time.perf_counter()
            records = await engine.run(specs)
            stats = client.cache_stats() if hasattr(client, "cache_stats") else {}
            return time.perf_counter() - started, records, {"cache": stats, "generation_s": engine.generation_s}

    step_s, records, stats = asyncio.run(step())
    calls = [c for r in records for c in r.tool_calls]
    return {
        "tools_client": str(source), "step_s": step_s,
        "kept": sum(not r.tool_failure for r in records), "tool_failures": sum(r.tool_failure for r in records),
        "finish_reasons": dict(collections.Counter(r.finish_reason for r in records)),
        "tool_calls": len(calls), "calls_ok": sum(c.status == "ok" for c in calls),
        "from_cache": sum(getattr(c, "cached", False) for c in calls),
        "throttled_waited_out": sum(getattr(c, "throttled", 0) for c in calls),
        "throttle_wait_s": sum(getattr(c, "throttle_wait_s", 0.0) for c in calls),
        "final_concurrency": min((c.concurrency for c in calls if getattr(c, "concurrency", None)), default=None),
        # The generation thread's busy time (engine.generation_s): it overlaps the tool waits.
        "cache_stats": stats["cache"], "generation_busy_s": stats["generation_s"],
    }


def measure(tree: Path, url: str, extra: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    # Run as a script (the baseline tree has no benchmarks/tools): this file from REPO, the rest from `tree`.
    done = subprocess.run([sys.executable, __file__, "--child", str(tree), "--url", url, "--extra", json.dumps(extra)],
                          cwd=tree, env=env, capture_output=True, text=True, check=False, timeout=300)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"measurement in {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


# --- the comparison ----------------------------------------------------------------------------

METRICS = [("step wall time (s)", "step_s", "{:.2f}"), ("requests reaching the endpoint", "requests", "{:.0f}"),
           ("  of them served (200)", "served", "{:.0f}"), ("  of them answered 429", "answered_429", "{:.0f}"),
           ("rollouts kept (of 64)", "kept", "{:.0f}"), ("tool failures (rollouts dropped)", "tool_failures", "{:.0f}"),
           ("calls answered from the cache", "from_cache", "{:.0f}"),
           ("429s waited out (no retry spent)", "throttled_waited_out", "{:.0f}"),
           ("seconds waited for them, all calls", "throttle_wait_s", "{:.1f}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fractional-retry-after", action="store_true")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a measurement, in that tree
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(args.child))
        print("RESULT " + json.dumps(child(args.child, args.url, json.loads(args.extra))), flush=True)
        return

    server = SearchServer(fractional_retry_after=args.fractional_retry_after)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tools-baseline-") as tmp, serve(server.app()) as port:
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), BASELINE_REV],
                       check=True, capture_output=True)
        try:
            for repeat in range(args.repeats):
                for name, (which, extra, limited) in CONFIGS.items():
                    server.reset()
                    server.limited = limited
                    result = measure(baseline if which == "baseline" else REPO, f"http://127.0.0.1:{port}/tools", extra)
                    result.update(server.counts())
                    if not result["served"]:
                        raise RuntimeError(f"{name}: no call reached the tool: {result}")
                    runs[name].append(result)
                    print(f"repeat {repeat + 1} {name}: {result['step_s']:.2f} s, {result['requests']} requests "
                          f"({result['answered_429']} x 429), kept {result['kept']}/64", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    medians = {name: {key: statistics.median(r[key] for r in rs) for _, key, _ in METRICS} for name, rs in runs.items()}
    names = list(CONFIGS)
    print(f"\n{PROMPTS} prompts x {GROUP} rollouts x {CALLS} search calls; tool: {LATENCY_S * 1000:.0f} ms, "
          f"{RATE_PER_S} requests/s (192 calls need >= {PROMPTS * GROUP * CALLS / RATE_PER_S:.1f} s at the limit); "
          f"medians of {args.repeats}\n")
    print(f"| measure | (a) baseline {BASELINE_REV} | (b) backpressure | (c) backpressure + cache "
          "| reference: no rate limit |\n|---|---|---|---|---|")
    for label, key, fmt in METRICS:
        print(f"| {label} | " + " | ".join(fmt.format(medians[n][key]) for n in names) + " |")
    results = RESULTS.with_name("tools_fractional_retry_after.json") if args.fractional_retry_after else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({
        "baseline_rev": BASELINE_REV, "prompts": PROMPTS, "group": GROUP, "calls_per_rollout": CALLS,
        "tool_latency_s": LATENCY_S, "rate_limit_per_s": RATE_PER_S, "repeats": args.repeats,
        "fractional_retry_after": args.fractional_retry_after, "configs": {n: {"tree": CONFIGS[n][0], "tool_fields": CONFIGS[n][1], "rate_limited": CONFIGS[n][2]}
                                                  for n in names},
        "medians": medians, "runs": runs, "wall_s": time.perf_counter() - started}, indent=2))
    print(f"\nwrote {results}")


if __name__ == "__main__":
    main()
