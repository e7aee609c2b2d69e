"""What the variance pages read: diagnostics (app/diagnostics: their models and result shape;
docs/diagnostics.md) and their rollouts, scoped to the viewer's project."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import unix
from agent_rft.tracing import w3c_trace_id
from app.dashboard.queries import numbered_page, transcript
from app.diagnostics import service as diagnostics
from app.diagnostics.models import Diagnostic, DiagnosticRollout
from app.diagnostics.state import ACTIVE, DiagnosticStatus

PER_PAGE = 25
# Colours of the signal classes (text on white passes WCAG AA for each).
SIGNAL_COLOURS = {"mixed": "#0a57c2", "always_0": "#b42318", "always_1": "#116329", "constant": "#8250df",
                  "ungraded": "#57606a"}
SIGNAL_LABELS = {"mixed": "mixed (signal)", "always_0": "always 0", "always_1": "always 1",
                 "constant": "constant other score", "ungraded": "could not be graded"}


def list_diagnostics(*, session: Session, project_id: str, page: int) -> dict[str, Any]:
    where = Diagnostic.project_id == project_id
    total, page, pages = numbered_page(session, Diagnostic, [where], page, PER_PAGE)
    rows = session.scalars(select(Diagnostic).where(where).order_by(Diagnostic.seq.desc())
                           .offset((page - 1) * PER_PAGE).limit(PER_PAGE))
    items = []
    for d in rows:
        verdict = (d.result or {}).get("verdict") or {}
        items.append({"id": d.id, "status": d.status, "model": d.model, "job_id": d.job_id,
                      "samples_done": d.samples_done, "samples_total": d.samples_total,
                      "runs_per_sample": d.runs_per_sample, "signal_share": verdict.get("signal_share"),
                      "level": verdict.get("level"), "created_at": unix(d.created_at),
                      "finished_at": unix(d.finished_at)})
    return {"diagnostics": items, "total": total, "page": page, "pages": pages}


def view(*, session: Session, project_id: str, diagnostic_id: str) -> dict[str, Any]:
    """The diagnostic as the API shows it (tool headers masked), plus what the page needs."""
    public = diagnostics.get(session=session, project_id=project_id, diagnostic_id=diagnostic_id)
    data = public.model_dump(mode="json")
    data["active"] = DiagnosticStatus(public.status) in ACTIVE
    data["samples"] = data.get("samples") or []
    data["sorted_samples"] = sorted(data["samples"], key=lambda s: (s["mean"] is None, s["mean"] or 0.0,
                                                                    s["sample_index"]))
    return data


def chart_points(data: dict[str, Any]) -> dict[str, Any]:
    """The per-sample chart, sorted by mean: one trace per signal class (their colours and
    legend), error bars from the lowest to the highest run, and every run as a small dot."""
    return {
        "status": data["status"], "active": data["active"], "progress": data["progress"],
        "samples": [{"sample_index": s["sample_index"], "mean": s["mean"], "std": s["std"], "signal": s["signal"],
                     "scores": s["scores"]} for s in data["sorted_samples"]],
        "colours": SIGNAL_COLOURS, "labels": SIGNAL_LABELS,
    }


def rollouts(*, session: Session, diagnostic_id: str, sample: int | None) -> list[dict[str, Any]]:
    stmt = select(DiagnosticRollout.trace_id, DiagnosticRollout.sample_index, DiagnosticRollout.run_index,
                  DiagnosticRollout.reward, DiagnosticRollout.finish_reason, DiagnosticRollout.tool_calls,
                  DiagnosticRollout.data["completion_tokens"], DiagnosticRollout.data["wall_time_s"],
                  DiagnosticRollout.data["excluded"]).where(DiagnosticRollout.diagnostic_id == diagnostic_id)
    if sample is not None:
        stmt = stmt.where(DiagnosticRollout.sample_index == sample)
    stmt = stmt.order_by(DiagnosticRollout.sample_index, DiagnosticRollout.run_index).limit(500)
    return [{"trace_id": r[0], "sample_index": r[1], "run_index": r[2], "reward": r[3], "finish_reason": r[4],
             "tool_calls": r[5], "completion_tokens": r[6], "wall_time_s": r[7], "excluded": r[8]}
            for r in session.execute(stmt)]


def rollout_detail(*, session: Session, diagnostic_id: str, trace_id: str) -> dict[str, Any] | None:
    row = session.scalar(select(DiagnosticRollout).where(DiagnosticRollout.diagnostic_id == diagnostic_id,
                                                         DiagnosticRollout.trace_id == trace_id))
    if row is None:
        return None
    record = row.data or {}
    return {
        "trace_id": row.trace_id, "step": None, "split": None, "run_index": row.run_index,
        "sample_index": row.sample_index, "reward": row.reward, "finish_reason": row.finish_reason,
        "tool_calls": row.tool_calls, "advantage": None, "excluded": record.get("excluded"),
        "grader_errors": record.get("grader_errors") or [], "grader_details": record.get("grader_details"),
        "sub_rewards": record.get("sub_rewards") or {}, "final_answer": record.get("final_answer"),
        "usage": {k: record.get(k) for k in ("prompt_tokens", "completion_tokens", "tool_output_tokens")},
        "turns": record.get("turns"), "parse_errors": record.get("parse_errors"),
        "wall_time_s": record.get("wall_time_s"), "entries": transcript(record),
        "w3c_trace_id": w3c_trace_id(row.trace_id),
    }
