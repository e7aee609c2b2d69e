"""The API under a burst of concurrent requests: requests a second, refusals, errors, and how long
`/healthz` takes meanwhile, for this tree and a baseline revision, in the same run.

Each tree's API runs as its own `uvicorn app.asgi:app` process (one process, the defaults: pool of
10 + 20 connections, 40 threads) on a fresh PostgreSQL database. For each concurrency, that many
clients send `GET /v1/models` (the cheapest authenticated route) back to back until `--requests`
have been answered, while one more client asks `/healthz` every 100 ms.

    .venv/bin/python -m benchmarks.api_load.run [--baseline 692e8b7] [--concurrency 50,100,200] \
        [--requests 2000] [--repeats 3]

Needs PostgreSQL on 127.0.0.1:5432 (AGENT_RFT_TEST_PG) and git (the baseline is checked out into a
temporary worktree). Prints a table and writes benchmarks/results/api_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.auth.service import create_project  # noqa: E402
from app.core.config import normalize_database_url  # noqa: E402
from app.core.db import make_engine, make_session_factory  # noqa: E402
from app.core.migrations import upgrade  # noqa: E402
from examples.financial_reports.demo import http_ok  # noqa: E402
from tests.conftest import fresh_pg_database, free_port, wait_for  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "api_load.json"


@contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """`revision` checked out into a temporary folder (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix="api-load-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(folder), revision], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], check=False)


@contextmanager
def api_process(tree: Path, database_url: str, data_dir: Path) -> Iterator[str]:
    """`uvicorn app.asgi:app` of `tree`, its own process; yields its URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "AGENT_RFT_DATABASE_URL": database_url,
           "AGENT_RFT_DATA_DIR": str(data_dir), "AGENT_RFT_BROKER_URL": "redis://127.0.0.1:6379/14"}
    log = (data_dir / "api.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.asgi:app", "--port", str(port),
                             "--log-level", "warning"], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{url}/healthz"), timeout=60, interval=0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def probe_health(url: str, stop: threading.Event, health: list[float]) -> None:
    """GET /healthz every 100 ms until `stop`, from its own thread and connection (not queued behind
    the burst's clients on their event loop); a timeout counts as the time it waited."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            began = time.perf_counter()
            try:
                client.get("/healthz")
            except httpx.TransportError:
                pass
            health.append(time.perf_counter() - began)
            stop.wait(0.1)


async def burst(url: str, key: str, concurrency: int, total: int) -> dict[str, Any]:
    """`concurrency` clients sending GET /v1/models until `total` are answered; /healthz polled meanwhile."""
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    health: list[float] = []
    remaining = total
    # One connection per httpx client: a client's pool costs time per request in proportion to its
    # connections, which made the load generator, not the API, the bottleneck at 200.
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
                   for _ in range(concurrency)]

        async def one_client(client: httpx.AsyncClient) -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                began = time.perf_counter()
                try:
                    answer = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                    refused = answer.status_code in (429, 503)
                    statuses[str(answer.status_code) + ("" if not refused or "retry-after" in answer.headers
                                                        else " without Retry-After")] += 1
                except httpx.TransportError as exc:
                    statuses[type(exc).__name__] += 1
                latencies.append(time.perf_counter() - began)

        stop = threading.Event()
        prober = threading.Thread(target=probe_health, args=(url, stop, health))
        prober.start()
        began, cpu_began = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one_client(client) for client in clients))
        elapsed, client_cpu = time.perf_counter() - began, time.process_time() - cpu_began
        stop.set()
        prober.join()
    latencies.sort()
    return {"concurrency": concurrency, "requests": total, "seconds": elapsed, "per_second": total / elapsed,
            "statuses": dict(statuses), "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)], "healthz_max_ms": 1000 * max(health),
            "client_cpu_s": client_cpu}


def measure(tree: Path, label: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with fresh_pg_database() as database_url, tempfile.TemporaryDirectory() as data:
        url_with_driver = normalize_database_url(database_url)
        upgrade(url_with_driver)
        engine = make_engine(url_with_driver)
        with make_session_factory(engine).begin() as session:
            key = create_project(session=session, name="load").secret
        engine.dispose()
        with api_process(tree, database_url, Path(data)) as url:
            asyncio.run(burst(url, key, 10, 100))  # warm-up: imports, first connections
            for concurrency in args.concurrency:
                runs = [asyncio.run(burst(url, key, concurrency, args.requests)) for _ in range(args.repeats)]
                median = sorted(runs, key=lambda r: r["per_second"])[len(runs) // 2]
                rows.append({"tree": label, **median, "runs": runs})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision to measure beside this tree")
    parser.add_argument("--concurrency", default="50,100,200", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    if args.baseline:
        with worktree(args.baseline) as tree:
            rows += measure(tree, f"baseline {args.baseline}", args)
    rows += measure(REPO, "this tree", args)
    print("| tree | concurrency | requests/s | p50 ms | p99 ms | /healthz max ms | client CPU s | answers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        answers = ", ".join(f"{n} × {s}" for s, n in sorted(r["statuses"].items()))
        print(f"| {r['tree']} | {r['concurrency']} | {r['per_second']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{r['healthz_max_ms']:.0f} | {r['client_cpu_s']:.1f} | {answers} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "median_of": args.repeats}, indent=2))
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
