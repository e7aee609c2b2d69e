"""The web dashboard under /dashboard: jobs, charts over training steps, the rollout browser, the
variance report and the comparison of an eval's runs, behind an API-key login (see docs/dashboard.md)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from app.core.errors import APIError
from app.dashboard.auth import CsrfFailed, LoginRequired

STATIC = Path(__file__).resolve().parent / "static"


def install(app: FastAPI) -> None:
    """Mount the pages, their static files and the errors they answer themselves. Call it after
    app.core.errors.install_error_handlers: the pages' APIError handler wraps the API's."""
    from urllib.parse import quote

    from app.dashboard.router import SECURITY_HEADERS, answer_service_error, router, templates

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

    # Handlers are app-wide (a router cannot have its own), so this one answers dashboard routes
    # as pages and passes every other APIError to the API's JSON handler it replaces.
    api_error = app.exception_handlers[APIError]

    @app.exception_handler(APIError)
    async def _service_error(request: Request, exc: APIError) -> Response:
        page = answer_service_error(request, exc)
        return page if page is not None else await api_error(request, exc)
