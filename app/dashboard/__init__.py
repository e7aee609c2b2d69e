"""The web dashboard under /dashboard: jobs, charts over training steps, the rollout browser and
the variance report, behind an API-key login (see docs/dashboard.md)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from app.dashboard.auth import CsrfFailed, LoginRequired

STATIC = Path(__file__).resolve().parent / "static"


def install(app: FastAPI) -> None:
    """Mount the pages, their static files and the two errors they answer themselves."""
    from urllib.parse import quote

    from app.dashboard.router import SECURITY_HEADERS, router, templates

    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=str(STATIC)), name="dashboard-static")

    @app.exception_handler(LoginRequired)
    async def _login_required(request: Request, exc: LoginRequired) -> Response:
        if exc.wants_json:
            return JSONResponse({"error": {"message": "Log in to the dashboard first.", "code": "login_required"}},
                                status_code=401)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if request.method != "GET":
            target = "/dashboard/jobs"
        return RedirectResponse(f"/dashboard/login?next={quote(target, safe='')}", status_code=303,
                                headers=SECURITY_HEADERS)

    @app.exception_handler(CsrfFailed)
    async def _csrf_failed(request: Request, exc: CsrfFailed) -> Response:
        response = templates.TemplateResponse(request, "forbidden.html", {"user": None}, status_code=403)
        response.headers.update(SECURITY_HEADERS)
        return response
