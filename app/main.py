"""The control plane's FastAPI application."""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.admission import DatabaseTurns
from app.core.config import Settings, get_settings
from app.core.crypto import secret_box
from app.core.db import make_engine, make_session_factory
from app.core.errors import error_body, install_error_handlers
from app.core.input_limits import InputLimits
from app.core.lifecycle import PeriodicLoop
from app.core.migrations import ensure_schema
from app.core.queue import JobQueue
from app.core.rate_limit import KeyRateLimiter
from app.diagnostics import pipeline as diagnostics_pipeline
from app.diagnostics.router import router as diagnostics_router
from app.diagnostics.watchdog import expire_diagnostic_leases
from app.evals import pipeline as evals_pipeline
from app.evals.router import router as evals_router
from app.evals.worker_router import router as evals_worker_router
from app.diagnostics.worker_router import router as diagnostics_worker_router
from app.dashboard import install as install_dashboard
from app.files.router import router as files_router
from app.files.storage import LocalStorage
from app.files.worker_router import router as files_worker_router
from app.graders.router import router as graders_router
from app.jobs import pipeline
from app.jobs.permissions_router import router as checkpoint_permissions_router
from app.jobs.router import router as jobs_router
from app.jobs.watchdog import expire_job_leases
from app.jobs.worker_router import router as jobs_worker_router
from app.observability.router import router as metrics_router
from app.responses.router import router as responses_router
from app.serving.router import router as serving_router
from app.tool_run.router import router as tool_run_router
from app.webhooks.dispatcher import sweep
from app.webhooks.outbox import install_dispatch
from app.webhooks.router import router as webhooks_router
from app.webhooks.worker_router import router as webhooks_worker_router

log = logging.getLogger(__name__)
MULTIPART_OVERHEAD = 64 * 1024


class UploadLimit:
    """Answer 413 before reading a body whose declared length is already over the upload limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/") == "/v1/files":
            length = dict(scope["headers"]).get(b"content-length")
            if length and length.isdigit() and int(length) > self.max_bytes + MULTIPART_OVERHEAD:
                from starlette.responses import JSONResponse

                body = error_body(f"File is larger than the {self.max_bytes}-byte upload limit.",
                                  type="invalid_request_error", code="file_too_large", param="file")
                await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    secret_box(settings)  # no key to seal stored secrets with: refuse to start (SecretKeysMissing says why)
    engine = make_engine(settings.resolved_database_url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_max_overflow)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        ensure_schema(engine, auto_migrate=settings.auto_migrate)
        # The threads that run synchronous routes and database work (docs/operations.md, "Under load").
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        state = app.state
        # Finish what a previous process left half done, without delaying start-up.
        threading.Thread(
            target=pipeline.recover, args=(state.session_factory, state.storage, state.queue),
            kwargs={"min_rows": settings.min_training_rows}, name="recover-jobs", daemon=True,
        ).start()
        threading.Thread(
            target=diagnostics_pipeline.recover, args=(state.session_factory, state.storage, state.queue),
            name="recover-diagnostics", daemon=True,
        ).start()
        threading.Thread(target=evals_pipeline.recover, args=(state.session_factory, state.queue),
                         name="recover-eval-runs", daemon=True).start()
        factory, queue = state.session_factory, state.queue

        def grace(first: bool) -> float | None:  # workers could not heartbeat while this API was down
            return settings.lease_seconds if first else None

        loops = [  # the runs whose worker went silent; due webhook deliveries
            PeriodicLoop("lease-watchdog", settings.watchdog_interval_s,
                         lambda first: expire_job_leases(factory, queue, restart_grace_s=grace(first)),
                         lambda first: expire_diagnostic_leases(factory, queue, restart_grace_s=grace(first)),
                         lambda first: evals_pipeline.expire_run_leases(factory, queue, restart_grace_s=grace(first))),
            PeriodicLoop("webhook-sweeper", settings.webhook_sweep_interval_s, lambda first: sweep(
                factory, queue.enqueue_webhook, redispatch_after_s=settings.webhook_redispatch_after_s, first=first)),
        ]
        for loop in loops:
            loop.start()
        yield
        if getattr(state, "inference", None) is not None:
            await state.inference.close()
        for loop in loops:
            loop.stop()
        state.queue.close()
        engine.dispose()

    app = FastAPI(
        title="agent-rft",
        version="0.1.0",
        summary="OpenAI-compatible reinforcement fine-tuning of open-weight agents that call real tools.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.database_turns = DatabaseTurns(settings.resolved_api_db_requests, settings.api_queue_timeout_s)
    app.state.storage = LocalStorage(settings.resolved_storage_dir)
    app.state.queue = JobQueue(settings)
    app.state.rate_limiter = (KeyRateLimiter(settings.api_rate_limit, settings.api_rate_limit_storage)
                              if settings.api_rate_limit else None)
    # Webhook deliveries written in a transaction go to the broker right after its commit.
    install_dispatch(app.state.session_factory, app.state.queue.enqueue_webhook)
    install_error_handlers(app)
    app.add_middleware(UploadLimit, max_bytes=settings.max_upload_bytes)
    # No NUL in a path, query, form or JSON string; JSON at most 64 levels deep (docs/security.md).
    app.add_middleware(InputLimits)
    for router in (files_router, jobs_router, checkpoint_permissions_router, graders_router, diagnostics_router,
                   evals_router, webhooks_router, serving_router, responses_router, tool_run_router):
        app.include_router(router)
    # /internal/v1: what workers call, with the worker token
    for router in (files_worker_router, jobs_worker_router, diagnostics_worker_router, evals_worker_router,
                   webhooks_worker_router):
        app.include_router(router)
    install_dashboard(app)
    app.include_router(metrics_router)  # GET /metrics for Prometheus (docs/observability.md)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Liveness: answered on the event loop, never behind the database or the thread pool."""
        return {"status": "ok"}

    return app
