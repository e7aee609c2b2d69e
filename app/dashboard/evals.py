"""What the eval pages read: the project's evals, one eval's runs with their result counts, and
the trajectories of one item in the runs being compared (app/evals/compare.py compares them)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.db import unix
from app.dashboard.queries import grader_summary, numbered_page, transcript
from app.evals.compare import criterion_names, measures
from app.evals.models import Eval, EvalOutputItem, EvalRun
from app.evals.service import eval_row
from app.evals.state import public_status

PER_PAGE = 25
# The per-item delta chart's colour of each quadrant (app/evals/compare.py::QUADRANTS).
QUADRANT_COLOURS = {
    "improved reward & fewer tools": "#116329", "improved reward & more tools": "#0a57c2",
    "improved reward & same tools": "#0e7490", "worse reward & fewer tools": "#9a6700",
    "worse reward & more tools": "#b42318", "worse reward & same tools": "#8250df", "same reward": "#57606a",
}


def list_evals(*, session: Session, project_id: str, page: int) -> dict[str, Any]:
    where = Eval.project_id == project_id
    total, page, pages = numbered_page(session, Eval, [where], page, PER_PAGE)
    runs = (select(func.count()).select_from(EvalRun).where(EvalRun.eval_id == Eval.id)
            .correlate(Eval).scalar_subquery())
    rows = session.execute(select(Eval.id, Eval.name, Eval.created_at, runs).where(where)
                           .order_by(Eval.seq.desc()).offset((page - 1) * PER_PAGE).limit(PER_PAGE))
    items = [{"id": r[0], "name": r[1], "created_at": unix(r[2]), "runs": r[3]} for r in rows]
    return {"evals": items, "total": total, "page": page, "pages": pages}


def _counts(run: EvalRun) -> dict[str, int]:
    """Output items by status, as the run's stored result counts them (kept current with every push)."""
    counts = (run.result or {}).get("result_counts") or {}
    return {"pass": counts.get("passed", 0), "fail": counts.get("failed", 0), "error": counts.get("errored", 0)}


def view(*, session: Session, project_id: str, eval_id: str) -> dict[str, Any]:
    """The eval, its criteria (name, type, what they check; never header values) and its runs,
    oldest first (a base model's run usually comes before its checkpoints')."""
    found = eval_row(session, project_id, eval_id)
    runs = list(session.scalars(select(EvalRun).where(EvalRun.eval_id == eval_id, EvalRun.project_id == project_id)
                                .order_by(EvalRun.seq)))
    names = criterion_names(found.testing_criteria)
    criteria = [{**grader_summary(c if isinstance(c, dict) else {}), "name": name}
                for c, name in zip(found.testing_criteria or [], names)]
    return {
        "id": found.id, "name": found.name, "created_at": unix(found.created_at), "criteria": criteria,
        "runs": [_run_row(r) for r in runs],
    }


def _run_row(run: EvalRun) -> dict[str, Any]:
    counts = _counts(run)
    return {"id": run.id, "name": run.name, "model": run.model or "—", "status": public_status(run.status),
            "counts": counts, "total": sum(counts.values()), "items_total": run.items_total,
            "created_at": unix(run.created_at)}


def _final_answer(row: EvalOutputItem) -> str | None:
    if isinstance(row.trajectory, dict) and row.trajectory.get("final_answer") is not None:
        return str(row.trajectory["final_answer"])
    output = (row.sample or {}).get("output") or []
    contents = [m.get("content") for m in output if isinstance(m, dict) and m.get("content") is not None]
    return str(contents[-1]) if contents else None


def _said(message: Any) -> Any:
    """An assistant message that only calls tools (OpenAI's `tool_calls`, no content) reads as its
    calls, so that its turn is not an empty box; the calls' outputs follow as tool entries."""
    if not isinstance(message, dict) or message.get("role") != "assistant" or message.get("content") \
            or not isinstance(message.get("tool_calls"), list):
        return message
    calls = [c.get("function") or {} for c in message["tool_calls"] if isinstance(c, dict)]
    return {**message, "content": "\n".join(f"→ {f.get('name')}({f.get('arguments') or ''})" for f in calls)}


def _record(row: EvalOutputItem) -> dict[str, Any]:
    """The conversation to show: the trajectory, or for a run without one its sample's input and output."""
    if isinstance(row.trajectory, dict):
        record = row.trajectory
    else:
        sample = row.sample or {}
        record = {"messages": [*(sample.get("input") or []), *(sample.get("output") or [])]}
    return {**record, "messages": [_said(m) for m in record.get("messages") or []]}


def trajectory(*, session: Session, run: dict[str, Any], item_index: int, sample_index: int,
               criteria: list[str]) -> dict[str, Any]:
    """One run's sample of one item as the side-by-side panel shows it (`run` from a comparison,
    whose runs compare_runs has already scoped to the project)."""
    row = session.scalar(select(EvalOutputItem).where(EvalOutputItem.run_id == run["id"],
                                                      EvalOutputItem.item_index == item_index,
                                                      EvalOutputItem.sample_index == sample_index))
    if row is None:
        return {"run": run, "found": False}
    counted = measures({"status": row.status, "results": row.results, "trajectory": row.trajectory,
                        "sample": row.sample}, criteria)
    record = _record(row)
    return {
        "run": run, "found": True, "id": row.id, "trace_id": row.trace_id, "status": row.status,
        "results": [r for r in row.results or [] if isinstance(r, dict)], "final_answer": _final_answer(row),
        "finish_reason": record.get("finish_reason") or (row.sample or {}).get("finish_reason"),
        "turns": record.get("turns"), "entries": transcript(record), "reward": counted["reward"],
        "tool_calls": counted["tool_calls"], "seconds": counted["seconds"], "tokens": counted["tokens"],
        "error": (row.sample or {}).get("error"),
    }


def samples_of(item: dict[str, Any], run_ids: list[str]) -> int:
    """How many samples the runs have of an item (the most any of them has)."""
    return max((len(item["runs"][rid]["output_item_ids"]) for rid in run_ids if rid in item["runs"]), default=0)
