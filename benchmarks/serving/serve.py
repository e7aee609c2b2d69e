"""An inference server for benchmarks/serving, in a process of its own: the service's own
(`--backend unified`: the engine through the sampler seam, what `agent-rft inference` runs) or the
frozen static loop it replaced (`--backend static`, static_loop.py), on the same model pool.

    .venv/bin/python -m benchmarks.serving.serve --backend unified --port 8101
"""

from __future__ import annotations

import argparse

import uvicorn

from app.core.config import Settings
from benchmarks.serving.static_loop import StaticScheduler
from workers.inference.pool import ModelPool
from workers.inference.server import create_inference_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["unified", "static"], required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    settings = Settings()
    backend = None
    if args.backend == "static":
        pool = ModelPool(bases=settings.inference_models, capacity=settings.inference_pool_size,
                         dtype=settings.inference_dtype, checkpoint_root=settings.resolved_checkpoint_dir)
        backend = StaticScheduler(pool, max_batch_size=settings.inference_max_batch_size, batch_window_s=0.01,
                                  default_max_tokens=settings.inference_default_max_tokens,
                                  max_waiting=settings.inference_max_queue, preload=settings.inference_models)
    uvicorn.run(create_inference_app(settings, backend=backend), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
