"""`/dashboard`: server-rendered pages over the same services as the API, plus the JSON the
job page polls for its charts. Pages answer HTML (a login redirect, a 404 page), never the
API's JSON errors: the routes let a service's APIError rise, and `answer_service_error` (the
app's APIError handler, see install()) answers it as the route would."""

from __future__ import annotations

import gzip
import json
import math
from datetime import datetime, timezone
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, BackgroundTasks, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from app.auth.service import authenticate
from app.core.deps import INT32_MAX, SessionDep
from app.core.errors import APIError
from app.dashboard import diagnostics as variance
from app.dashboard import evals as eval_pages
from app.dashboard import queries
from app.dashboard.auth import (
    CSRF_FIELD,
    DashboardUser,
    DataUser,
    PageUser,
    caller_of,
    check_csrf,
    forget_visitor,
    key_is_live,
    new_visitor,
    read_visitor,
    write_visitor,
)
from app.dashboard.charts import chart_specs
from app.evals.compare import QUADRANTS, compare_runs, comparison_csv
from app.jobs import pipeline
from app.jobs import service as jobs
from app.jobs import step_metrics
from app.jobs.state import ACTIONS, JobStatus

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(prefix="/dashboard", include_in_schema=False)

SECURITY_HEADERS = {
    # plotly.js adds <style> elements at run time, hence 'unsafe-inline' for styles only.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data: blob:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
NOTICES = {
    "paused": "Job paused. A running worker saves its state and stops within a heartbeat.",
    "resumed": "Job resumed: its worker carries on if it had not stopped yet, else the next free worker resumes it.",
    "cancelled": "Job cancelled.",
    "refused": "That action is not allowed in the job's current status.",
}


# --- template helpers ---------------------------------------------------------------------

def _utc(ts: int | None) -> str:
    if ts is None:
        return "—"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(ts: int | None) -> str:
    return "" if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _show(value: Any) -> str:
    """A configuration value as the user wrote it: JSON for objects and lists."""
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


templates.env.filters.update(utc=_utc, iso=_iso, duration=_duration, num=_num, show=_show)
templates.env.globals.update(csrf_field=CSRF_FIELD)


def _plotly_path() -> Path:
    return Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))


@lru_cache(maxsize=1)
def _plotly_bytes() -> tuple[bytes, bytes, str]:
    raw = _plotly_path().read_bytes()
    version = raw[:200].split(b"plotly.js v", 1)[-1].split(None, 1)[0].decode(errors="replace")
    return raw, gzip.compress(raw, 6), version


def plotly_version() -> str:
    return _plotly_bytes()[2]


def _page(request: Request, template: str, context: dict[str, Any], *, user: DashboardUser | None = None,
          status_code: int = 200) -> HTMLResponse:
    settings = request.app.state.settings
    context = {"user": user, "poll_s": settings.dashboard_poll_s, "plotly_version": plotly_version(), **context}
    response = templates.TemplateResponse(request, template, context, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


def _redirect(url: str) -> RedirectResponse:
    response = RedirectResponse(url, status_code=303)
    response.headers.update(SECURITY_HEADERS)
    return response


def _not_found(request: Request, user: DashboardUser, what: str) -> HTMLResponse:
    return _page(request, "not_found.html", {"what": what}, user=user, status_code=404)


# The path parameter that names what a page is about, and its noun on the not-found page.
SUBJECTS = {"job_id": "job", "diagnostic_id": "diagnostic", "eval_id": "eval"}


def _missing(exc: APIError, params: dict[str, Any]) -> str:
    """What the not-found page says is missing: the page's subject, or on an eval's pages the
    eval or run the service named (a compared run comes from the query, not the path)."""
    if "eval_id" in params and exc.message.startswith("No such "):  # app.core.errors.not_found's words
        return exc.message.removeprefix("No such ").replace(": '", " ", 1).removesuffix("'")
    return next((f"{noun} {params[key]}" for key, noun in SUBJECTS.items() if key in params), "page")


def answer_service_error(request: Request, exc: APIError) -> Response | None:
    """A service's APIError on a logged-in dashboard route, answered as that route means it: the
    short JSON error for the poll and the CSV, the not-found page, or, for a job action the job's
    status refuses, its page with a notice. None leaves it to the API's JSON handler."""
    caller = caller_of(request)
    if caller is None:
        return None
    if caller.wants_json:
        return JSONResponse({"error": {"message": exc.message, "code": exc.code}}, status_code=exc.status_code)
    params = request.path_params
    if exc.status_code == 404:
        return _not_found(request, caller.user, _missing(exc, params))
    if request.method == "POST" and "job_id" in params:  # the job actions: the only forms a service refuses
        return _redirect(f"/dashboard/jobs/{params['job_id']}?notice=refused")
    if request.method == "GET" and exc.status_code == 400:  # a page asked for something the service refuses
        back = f"/dashboard/evals/{params['eval_id']}" if "eval_id" in params else "/dashboard/jobs"
        return _page(request, "error.html", {"message": exc.message, "back": back}, user=caller.user,
                     status_code=400)
    return None


def _safe_next(target: str | None) -> str:
    """Only a path inside the dashboard: never an open redirect."""
    if target and target.startswith("/dashboard") and "//" not in target and "\\" not in target:
        return target
    return "/dashboard/jobs"


# --- static ---------------------------------------------------------------------------------

@router.get("/vendor/plotly.min.js")
def plotly_js(request: Request) -> Response:
    """plotly.js from the installed `plotly` package: the dashboard needs no CDN."""
    raw, compressed, _ = _plotly_bytes()
    headers = {"Cache-Control": "public, max-age=31536000, immutable", "Vary": "Accept-Encoding",
               "X-Content-Type-Options": "nosniff"}
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(compressed, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"})
    return Response(raw, media_type="text/javascript", headers=headers)


# --- login ----------------------------------------------------------------------------------

@router.get("", response_class=HTMLResponse)
@router.get("/", response_class=HTMLResponse)
def home() -> RedirectResponse:
    return _redirect("/dashboard/jobs")


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, session: SessionDep, next: str | None = None) -> Response:
    visitor = read_visitor(request)
    if visitor is not None and visitor.project_id and visitor.key_id \
            and key_is_live(session, visitor.key_id, visitor.project_id):
        return _redirect(_safe_next(next))  # already logged in
    if visitor is None or visitor.project_id:  # a fresh token for every new login attempt
        visitor = new_visitor()
    response = _page(request, "login.html", {"csrf": visitor.csrf, "next": _safe_next(next), "error": None})
    write_visitor(request, response, visitor)
    return response


@router.post("/login", response_class=HTMLResponse)
def login(
    request: Request, session: SessionDep, api_key: str = Form(""), csrf_token: str = Form(""),
    next: str = Form("/dashboard/jobs"),
) -> Response:
    visitor = read_visitor(request)
    check_csrf(visitor, csrf_token)
    principal = authenticate(session=session, secret=api_key.strip()) if api_key.strip() else None
    if principal is None:
        response = _page(request, "login.html", {"csrf": visitor.csrf, "next": _safe_next(next),
                                                 "error": "That API key is not valid."}, status_code=401)
        return response
    response = _redirect(_safe_next(next))
    write_visitor(request, response, new_visitor(principal.project_id, principal.key_id))
    return response


@router.post("/logout")
def logout(request: Request, csrf_token: str = Form("")) -> Response:
    check_csrf(read_visitor(request), csrf_token)
    response = _redirect("/dashboard/login")
    forget_visitor(response)
    return response


# --- jobs -----------------------------------------------------------------------------------

def _int(value: str | None, errors: list[str], name: str, minimum: int = 0) -> int | None:
    if value is None or value.strip() == "":
        return None
    try:
        number = int(value)
    except ValueError:
        errors.append(f"{name} must be a whole number")
        return None
    if not minimum <= number <= INT32_MAX:
        errors.append(f"{name} must be between {minimum} and {INT32_MAX:,}")
        return None
    return number


def _float(value: str | None, errors: list[str], name: str) -> float | None:
    if value is None or value.strip() == "":
        return None
    try:
        number = float(value)
    except ValueError:
        errors.append(f"{name} must be a number")
        return None
    if not math.isfinite(number):
        errors.append(f"{name} must be a finite number")
        return None
    return number


@router.get("/jobs", response_class=HTMLResponse)
def jobs_page(request: Request, user: PageUser, session: SessionDep, status: str | None = None,
              page: str | None = None) -> HTMLResponse:
    statuses = [s.value for s in JobStatus]
    status = status if status in statuses else None
    number = _int(page, [], "page", minimum=1) or 1
    listing = queries.list_jobs(session=session, project_id=user.project_id, status=status, page=number)
    return _page(request, "jobs.html", {"listing": listing, "status": status, "statuses": statuses}, user=user)


def _job_data(session: Any, user: DashboardUser, job_id: str, after_step: int) -> dict[str, Any]:
    job = queries.job_status(session=session, project_id=user.project_id, job_id=job_id)  # first: an unknown job 404s
    return {
        "series": queries.chart_series(session=session, job_id=job_id, method=job["method"], after_step=after_step),
        "job": job,
        "checkpoints": queries.checkpoints(session=session, job_id=job_id),
        "events": queries.recent_events(session=session, job_id=job_id),
    }


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: str, user: PageUser, session: SessionDep, notice: str | None = None) -> HTMLResponse:
    header = queries.job_header(session=session, project_id=user.project_id, job_id=job_id)
    config = {"dataUrl": f"/dashboard/jobs/{job_id}/data", "pollMs": int(request.app.state.settings.dashboard_poll_s * 1000),
              "active": header["active"], "charts": chart_specs(header["method"]),
              "headlines": queries.headlines(header["method"]), "rolloutsUrl": f"/dashboard/jobs/{job_id}/rollouts"}
    return _page(request, "job.html", {
        "job": header, "config": config, "notice": NOTICES.get(notice or ""),
        "checkpoints": queries.checkpoints(session=session, job_id=job_id),
        "events": queries.recent_events(session=session, job_id=job_id),
    }, user=user)


@router.get("/jobs/{job_id}/data")
def job_data(job_id: str, user: DataUser, session: SessionDep,
             after_step: Annotated[int, Query(ge=-1, le=INT32_MAX)] = -1) -> JSONResponse:
    """The job's status, its charted series (only steps after `after_step`, so that a poll of a
    long job sends just what is new), checkpoints and recent events."""
    return JSONResponse(_job_data(session, user, job_id, after_step), headers={"Cache-Control": "no-store"})


@router.get("/jobs/{job_id}/metrics.csv")
def metrics_csv(job_id: str, user: DataUser, session: SessionDep) -> Response:
    """Every per-step metric as one CSV row per step, for a notebook."""
    jobs.get_row(session=session, project_id=user.project_id, job_id=job_id)
    return Response(step_metrics.step_metrics_csv(session=session, job_id=job_id), media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'})


@router.post("/jobs/{job_id}/{action}")
def job_action(request: Request, job_id: str, action: str, user: PageUser, session: SessionDep,
               background: BackgroundTasks, csrf_token: str = Form("")) -> Response:
    check_csrf(read_visitor(request), csrf_token)
    if action not in ACTIONS:
        return _not_found(request, user, f"action {action}")
    job = jobs.apply_action(session=session, project_id=user.project_id, job_id=job_id, action=action)
    if job.status == "queued":  # after SessionDep's commit, as the API's resume does
        pipeline.send_after_response(background, request, job_id)
    past = {"pause": "paused", "resume": "resumed", "cancel": "cancelled"}[action]
    return _redirect(f"/dashboard/jobs/{job_id}?notice={past}")


# --- rollouts -------------------------------------------------------------------------------

@router.get("/jobs/{job_id}/rollouts", response_class=HTMLResponse)
def rollouts_page(
    request: Request, job_id: str, user: PageUser, session: SessionDep, step: str | None = None,
    split: str | None = None, sample: str | None = None, reward_min: str | None = None,
    reward_max: str | None = None, finish_reason: str | None = None, tool: str | None = None,
    after: str | None = None,
) -> HTMLResponse:
    header = queries.job_header(session=session, project_id=user.project_id, job_id=job_id)
    errors: list[str] = []
    f = queries.RolloutFilter(
        step=_int(step, errors, "step"), split=split if split in ("train", "valid") else None,
        sample=_int(sample, errors, "sample"), reward_min=_float(reward_min, errors, "minimum reward"),
        reward_max=_float(reward_max, errors, "maximum reward"),
        finish_reason=finish_reason if finish_reason in queries.FINISH_REASONS else None,
        tool=tool or None,
    )
    listing = queries.list_rollouts(session=session, job_id=job_id, f=f, after=after or None)
    if listing["cursor_error"]:
        errors.append(listing["cursor_error"])
    query = f.query()
    next_url = f"?{urlencode({**query, 'after': listing['next_after']})}" if listing["next_after"] else None
    return _page(request, "rollouts.html", {
        "job": header, "filter": f, "listing": listing, "errors": errors, "next_url": next_url,
        "first_url": f"?{urlencode(query)}" if after else None, "finish_reasons": queries.FINISH_REASONS,
        "tool_names": sorted({t["name"] for t in header["tools"] if t.get("name")} | ({f.tool} if f.tool else set())),
    }, user=user)


@router.get("/jobs/{job_id}/rollouts/{trace_id}", response_class=HTMLResponse)
def rollout_page(request: Request, job_id: str, trace_id: str, user: PageUser, session: SessionDep) -> HTMLResponse:
    jobs.get_row(session=session, project_id=user.project_id, job_id=job_id)
    rollout = queries.rollout_detail(session=session, job_id=job_id, trace_id=trace_id)
    if rollout is None:
        return _not_found(request, user, f"rollout {trace_id}")
    base = f"/dashboard/jobs/{job_id}"
    crumbs = [("Jobs", "/dashboard/jobs"), (job_id, base), ("Rollouts", f"{base}/rollouts")]
    return _page(request, "rollout.html", {"rollout": rollout, "crumbs": crumbs, "list_url": f"{base}/rollouts"},
                 user=user)


# --- variance diagnostics -------------------------------------------------------------------

@router.get("/diagnostics", response_class=HTMLResponse)
def diagnostics_page(request: Request, user: PageUser, session: SessionDep, page: str | None = None) -> HTMLResponse:
    number = _int(page, [], "page", minimum=1) or 1
    listing = variance.list_diagnostics(session=session, project_id=user.project_id, page=number)
    return _page(request, "diagnostics.html", {"listing": listing}, user=user)


@router.get("/diagnostics/{diagnostic_id}", response_class=HTMLResponse)
def diagnostic_page(request: Request, diagnostic_id: str, user: PageUser, session: SessionDep) -> HTMLResponse:
    data = variance.view(session=session, project_id=user.project_id, diagnostic_id=diagnostic_id)
    config = {"kind": "diagnostic", "dataUrl": f"/dashboard/diagnostics/{diagnostic_id}/data",
              "pollMs": int(request.app.state.settings.dashboard_poll_s * 1000), "active": data["active"],
              "rolloutsUrl": f"/dashboard/diagnostics/{diagnostic_id}/rollouts"}
    return _page(request, "diagnostic.html", {"d": data, "config": config, "colours": variance.SIGNAL_COLOURS,
                                              "labels": variance.SIGNAL_LABELS}, user=user)


@router.get("/diagnostics/{diagnostic_id}/data")
def diagnostic_data(diagnostic_id: str, user: DataUser, session: SessionDep) -> JSONResponse:
    data = variance.view(session=session, project_id=user.project_id, diagnostic_id=diagnostic_id)
    return JSONResponse(variance.chart_points(data), headers={"Cache-Control": "no-store"})


@router.get("/diagnostics/{diagnostic_id}/rollouts", response_class=HTMLResponse)
def diagnostic_rollouts_page(request: Request, diagnostic_id: str, user: PageUser, session: SessionDep,
                             sample: str | None = None) -> HTMLResponse:
    data = variance.view(session=session, project_id=user.project_id, diagnostic_id=diagnostic_id)
    errors: list[str] = []
    index = _int(sample, errors, "sample")
    runs = variance.rollouts(session=session, diagnostic_id=diagnostic_id, sample=index)
    result = next((s for s in data["samples"] if s["sample_index"] == index), None) if index is not None else None
    return _page(request, "diagnostic_rollouts.html", {"d": data, "runs": runs, "sample": index, "result": result,
                                                       "errors": errors, "labels": variance.SIGNAL_LABELS}, user=user)


@router.get("/diagnostics/{diagnostic_id}/rollouts/{trace_id}", response_class=HTMLResponse)
def diagnostic_rollout_page(request: Request, diagnostic_id: str, trace_id: str, user: PageUser,
                            session: SessionDep) -> HTMLResponse:
    variance.view(session=session, project_id=user.project_id, diagnostic_id=diagnostic_id)
    rollout = variance.rollout_detail(session=session, diagnostic_id=diagnostic_id, trace_id=trace_id)
    if rollout is None:
        return _not_found(request, user, f"rollout {trace_id}")
    base = f"/dashboard/diagnostics/{diagnostic_id}"
    crumbs = [("Diagnostics", "/dashboard/diagnostics"), (diagnostic_id, base), ("Rollouts", f"{base}/rollouts")]
    return _page(request, "rollout.html", {"rollout": rollout, "crumbs": crumbs, "list_url": f"{base}/rollouts"},
                 user=user)


# --- evals ----------------------------------------------------------------------------------

@router.get("/evals", response_class=HTMLResponse)
def evals_page(request: Request, user: PageUser, session: SessionDep, page: str | None = None) -> HTMLResponse:
    number = _int(page, [], "page", minimum=1) or 1
    listing = eval_pages.list_evals(session=session, project_id=user.project_id, page=number)
    return _page(request, "evals.html", {"listing": listing}, user=user)


@router.get("/evals/{eval_id}", response_class=HTMLResponse)
def eval_page(request: Request, eval_id: str, user: PageUser, session: SessionDep) -> HTMLResponse:
    data = eval_pages.view(session=session, project_id=user.project_id, eval_id=eval_id)
    return _page(request, "eval.html", {"e": data}, user=user)


RunsQuery = Annotated[list[str] | None, Query()]


def _comparison(session: Any, user: DashboardUser, eval_id: str, runs: list[str] | None,
                baseline: str | None) -> dict[str, Any]:
    return compare_runs(session=session, project_id=user.project_id, eval_id=eval_id, run_ids=runs or [],
                        baseline_run_id=baseline or None)


def _trajectories(session: Any, comparison: dict[str, Any], pair: list[str], index: int | None,
                  sample: int, errors: list[str]) -> dict[str, Any] | None:
    """The chosen item's sample in the baseline and the other run, side by side."""
    if index is None:
        return None
    item = next((i for i in comparison["items"] if i["item_index"] == index), None)
    if item is None:
        errors.append(f"None of these runs has item {index}.")
        return None
    runs = {r["id"]: r for r in comparison["runs"]}
    panels = [eval_pages.trajectory(session=session, run=runs[rid], item_index=index, sample_index=sample,
                                    criteria=comparison["criteria"]) for rid in pair]
    return {"item": item, "sample": sample, "samples": eval_pages.samples_of(item, pair), "panels": panels}


@router.get("/evals/{eval_id}/compare", response_class=HTMLResponse)
def eval_compare_page(request: Request, eval_id: str, user: PageUser, session: SessionDep, runs: RunsQuery = None,
                      baseline: str | None = None, vs: str | None = None, item: str | None = None,
                      sample: str | None = None) -> HTMLResponse:
    comparison = _comparison(session, user, eval_id, runs, baseline)
    baseline = comparison["baseline_run_id"]
    ids = [r["id"] for r in comparison["runs"]]
    others = [rid for rid in ids if rid != baseline]
    vs = vs if vs in others else others[0]
    errors: list[str] = []
    index, number = _int(item, errors, "item"), _int(sample, errors, "sample") or 0
    detail = _trajectories(session, comparison, [baseline, vs], index, number, errors)
    query = urlencode({"runs": ",".join(ids), "baseline": baseline})
    item_url = f"/dashboard/evals/{eval_id}/compare?{query}&{urlencode({'vs': vs})}&item="
    config = {"dataUrl": f"/dashboard/evals/{eval_id}/compare/data?{query}", "baseline": baseline, "vs": vs,
              "itemUrl": item_url, "quadrants": QUADRANTS, "colours": eval_pages.QUADRANT_COLOURS}
    return _page(request, "eval_compare.html", {
        "e": eval_pages.view(session=session, project_id=user.project_id, eval_id=eval_id), "c": comparison,
        "runs": {r["id"]: r for r in comparison["runs"]}, "others": others, "vs": vs, "query": query,
        "item_url": item_url, "index": index,
        "errors": errors, "detail": detail,
        "config": config, "quadrants": QUADRANTS, "colours": eval_pages.QUADRANT_COLOURS,
    }, user=user)


@router.get("/evals/{eval_id}/compare/data")
def eval_compare_data(eval_id: str, user: DataUser, session: SessionDep, runs: RunsQuery = None,
                      baseline: str | None = None) -> JSONResponse:
    """The comparison (app/evals/compare.py::compare_runs) the compare page's charts draw."""
    return JSONResponse(_comparison(session, user, eval_id, runs, baseline), headers={"Cache-Control": "no-store"})


@router.get("/evals/{eval_id}/compare.csv")
def eval_compare_csv(eval_id: str, user: DataUser, session: SessionDep, runs: RunsQuery = None,
                     baseline: str | None = None, per_item: bool = False) -> Response:
    """The comparison as CSV: one row per run, or per item with `per_item=true`."""
    text = comparison_csv(_comparison(session, user, eval_id, runs, baseline), per_item=per_item)
    name = f"{eval_id}-compare{'-items' if per_item else ''}.csv"
    return Response(text, media_type="text/csv", headers={"Content-Disposition": f'attachment; filename="{name}"'})
