"""Runs of one eval compared item by item: a base model against its fine-tuned checkpoints, as the
Agent RFT material does by hand (mean reward against latency, output tokens and tool calls per
trace; per item, the change in reward and in tool calls).

`compare` is a pure function over row dicts (an eval, its runs, their output items);
`compare_runs` reads those rows for one project and checks the request. `format_comparison`
and `comparison_csv` render the result as a text table and as CSV.

What each output item (one sample of one data-source item) counts for:

- reward: the first testing criterion's score (None when it could not be graded);
  passed: its status is "pass"; errored: its status is "error";
- tool calls: the calls of its trajectory (0 without one, e.g. a run over a jsonl of samples);
- seconds: the trajectory's wall time (None without one);
- tokens: the trajectory's completion and tool output tokens, else the sample's completion tokens.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import bad_request, not_found
from app.evals.models import EvalOutputItem, EvalRun
from app.evals.service import eval_row
from app.evals.state import public_status

MAX_RUNS = 10
SAME_REWARD = "same reward"
QUADRANTS = ("improved reward & fewer tools", "improved reward & more tools", "worse reward & fewer tools",
             "worse reward & more tools", "improved reward & same tools", "worse reward & same tools", SAME_REWARD)
EPSILON = 1e-9  # a difference smaller than this is no difference (float noise of means)


# --- statistics ---------------------------------------------------------------------------------

def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _std(values: Iterable[float | None]) -> float | None:
    """The population standard deviation (divided by n, not n - 1): 0.0 for one value, None for none."""
    known = [v for v in values if v is not None]
    mean = _mean(known)
    if mean is None:
        return None
    return math.sqrt(sum((v - mean) ** 2 for v in known) / len(known))


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _difference(after: float | None, before: float | None) -> float | None:
    if after is None or before is None:
        return None
    delta = after - before
    return 0.0 if abs(delta) < EPSILON else delta


def quadrant(reward_delta: float | None, tool_delta: float | None) -> str | None:
    """Where an item moved: better or worse reward, with fewer, more or the same tool calls; a
    reward delta of 0 is "same reward" whatever the tools did. None when either delta is unknown
    (the item was not graded in one of the runs)."""
    if reward_delta is None or tool_delta is None:
        return None
    if reward_delta == 0:
        return SAME_REWARD
    reward = "improved reward" if reward_delta > 0 else "worse reward"
    tools = "fewer tools" if tool_delta < 0 else "more tools" if tool_delta > 0 else "same tools"
    return f"{reward} & {tools}"


# --- one output item ----------------------------------------------------------------------------

def _tokens(trajectory: dict[str, Any] | None, sample: dict[str, Any] | None) -> float | None:
    if trajectory is not None:
        parts = [_number(trajectory.get(k)) for k in ("completion_tokens", "tool_output_tokens")]
        if any(p is not None for p in parts):
            return sum(p or 0.0 for p in parts)
    usage = (sample or {}).get("usage") or {}
    return _number(usage.get("completion_tokens")) if isinstance(usage, dict) else None


def measures(row: dict[str, Any], criteria: list[str]) -> dict[str, Any]:
    """What one output item counts for (see the module's docstring)."""
    results = [r if isinstance(r, dict) else {} for r in row.get("results") or []]
    trajectory = row.get("trajectory") if isinstance(row.get("trajectory"), dict) else None
    calls = [c for c in (trajectory or {}).get("tool_calls") or [] if isinstance(c, dict)]
    by_tool: dict[str, int] = defaultdict(int)
    for call in calls:
        by_tool[str(call.get("name"))] += 1
    return {
        "reward": _number(results[0].get("score")) if results else None,
        "passed": row.get("status") == "pass", "errored": row.get("status") == "error",
        "tool_calls": len(calls), "by_tool": dict(by_tool),
        "seconds": _number((trajectory or {}).get("wall_time_s")),
        "tokens": _tokens(trajectory, row.get("sample")),
        "criteria": {name: bool(results[i].get("passed")) if i < len(results) else False
                     for i, name in enumerate(criteria)},
    }


# --- a run and an item --------------------------------------------------------------------------

def _run_summary(run: dict[str, Any], samples: list[dict[str, Any]], tools: list[str],
                 criteria: list[str]) -> dict[str, Any]:
    n = len(samples)
    return {
        "id": run["id"], "name": run.get("name"), "model": run.get("model"),
        "status": public_status(run["status"]),
        "items": len({s["item_index"] for s in samples}), "samples": n,
        "errored": sum(s["errored"] for s in samples),
        "mean_reward": _mean(s["reward"] for s in samples), "reward_std": _std(s["reward"] for s in samples),
        "pass_rate": _share([s["passed"] for s in samples]),
        **{f"{key}_{stat}": fn(s[key] for s in samples)
           for key in ("seconds", "tokens", "tool_calls") for stat, fn in (("mean", _mean), ("std", _std))},
        "tool_calls_by_tool": {t: sum(s["by_tool"].get(t, 0) for s in samples) / n if n else None for t in tools},
        "pass_rate_by_criterion": {c: _share([s["criteria"][c] for s in samples]) for c in criteria},
    }


def _item_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's samples of one item: their means."""
    return {"reward": _mean(s["reward"] for s in samples), "pass_rate": _share([s["passed"] for s in samples]),
            "tool_calls": _mean(s["tool_calls"] for s in samples), "seconds": _mean(s["seconds"] for s in samples),
            "tokens": _mean(s["tokens"] for s in samples), "output_item_ids": [s["id"] for s in samples]}


def _delta(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    reward = _difference(other["reward"], base["reward"])
    tools = _difference(other["tool_calls"], base["tool_calls"])
    return {"reward": reward, "tool_calls": tools, "quadrant": quadrant(reward, tools)}


def criterion_names(testing_criteria: list[dict[str, Any]]) -> list[str]:
    """The criteria's names in order; an unnamed one is called by its type, a repeated name gets
    its position ("exact (2)") so that every name keys one criterion."""
    names: list[str] = []
    for i, criterion in enumerate(testing_criteria or []):
        criterion = criterion if isinstance(criterion, dict) else {}
        name = str(criterion.get("name") or criterion.get("type") or f"criterion {i + 1}")
        names.append(f"{name} ({i + 1})" if name in names else name)
    return names


# --- the comparison -----------------------------------------------------------------------------

def compare(*, eval_row: dict[str, Any], runs: list[dict[str, Any]], items: list[dict[str, Any]],
            baseline_run_id: str | None = None) -> dict[str, Any]:
    """The comparison of `runs` (dicts with id, name, model and the stored status) of the eval
    `eval_row` (id, testing_criteria) from their output items (dicts with id, run_id, item_index,
    sample_index, status, results, sample, trajectory, datasource_item), against the baseline
    (the first run unless named).

    Per run: means over its samples, each with its population standard deviation (0.0 for one
    sample, None where no sample has the measure), pass rates, tool calls per sample by tool.
    Per item (every item_index any run has, in order): each run's means over that item's samples
    and, for every other run that has the item as the baseline does, its deltas from the
    baseline (reward, tool calls) and its quadrant (see `quadrant`: "improved reward & fewer
    tools", "improved reward & more tools", "worse reward & fewer tools", "worse reward & more
    tools"; a tool delta of 0 gives "improved reward & same tools" or "worse reward & same tools",
    a reward delta of 0 "same reward"). `quadrants` counts every label for each other run; an
    item that one of the two runs lacks (no delta) or could not grade (no quadrant) is not counted."""
    criteria = criterion_names(eval_row.get("testing_criteria") or [])
    baseline = baseline_run_id or runs[0]["id"]
    samples: dict[str, list[dict[str, Any]]] = {r["id"]: [] for r in runs}
    for row in items:
        if row["run_id"] in samples:
            samples[row["run_id"]].append({"id": row["id"], "item_index": row["item_index"],
                                           "sample_index": row.get("sample_index", 0), **measures(row, criteria)})
    tools = sorted({t for rows in samples.values() for s in rows for t in s["by_tool"]})
    others = [r["id"] for r in runs if r["id"] != baseline]
    compared = _items(runs, items, samples, baseline, others)
    quadrants = {rid: dict.fromkeys(QUADRANTS, 0) for rid in others}
    for item in compared:
        for rid, delta in item["deltas"].items():
            if delta["quadrant"] is not None:
                quadrants[rid][delta["quadrant"]] += 1
    return {"object": "eval.comparison", "eval_id": eval_row["id"], "baseline_run_id": baseline, "criteria": criteria,
            "runs": [_run_summary(r, samples[r["id"]], tools, criteria) for r in runs],
            "items": compared, "quadrants": quadrants}


def _items(runs: list[dict[str, Any]], rows: list[dict[str, Any]], samples: dict[str, list[dict[str, Any]]],
           baseline: str, others: list[str]) -> list[dict[str, Any]]:
    """Every item any run has: each run's means over its samples, and the deltas of the other runs."""
    by_item: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for rid, run_samples in samples.items():
        for s in sorted(run_samples, key=lambda s: s["sample_index"]):
            by_item[s["item_index"]][rid].append(s)
    sources: dict[int, Any] = {}
    for row in sorted(rows, key=lambda r: r["run_id"] != baseline):  # the baseline's copy first
        sources.setdefault(row["item_index"], row.get("datasource_item"))
    out = []
    for index in sorted(by_item):
        per_run = {r["id"]: _item_summary(by_item[index][r["id"]]) for r in runs if by_item[index].get(r["id"])}
        deltas = {rid: _delta(per_run[baseline], per_run[rid]) for rid in others
                  if baseline in per_run and rid in per_run}
        out.append({"item_index": index, "datasource_item": sources.get(index), "runs": per_run, "deltas": deltas})
    return out


# --- from the database --------------------------------------------------------------------------

def _run_ids(run_ids: list[str]) -> list[str]:
    """Run ids as a query gives them (repeated, comma-separated, or both): distinct, in order, blanks dropped."""
    parts = (part.strip() for value in run_ids for part in (value or "").split(","))
    return list(dict.fromkeys(part for part in parts if part))


def _check_request(ids: list[str], baseline_run_id: str | None) -> None:
    if len(ids) < 2:
        raise bad_request("Compare at least 2 distinct runs of the eval.", param="run_ids")
    if len(ids) > MAX_RUNS:
        raise bad_request(f"Compare at most {MAX_RUNS} runs at once; {len(ids)} were given.", param="run_ids")
    if baseline_run_id is not None and baseline_run_id not in ids:
        raise bad_request(f"The baseline run '{baseline_run_id}' is not one of the compared runs.",
                          param="baseline")


def _load_runs(session: Session, project_id: str, eval_id: str, ids: list[str]) -> list[dict[str, Any]]:
    """The runs in the order asked; a run of another project is not found, as an unknown one."""
    found = {r.id: r for r in session.scalars(select(EvalRun).where(EvalRun.id.in_(ids),
                                                                    EvalRun.project_id == project_id))}
    for rid in ids:
        if rid not in found:
            raise not_found("eval run", rid, param="run_ids")
        if found[rid].eval_id != eval_id:
            raise bad_request(f"Run '{rid}' belongs to another eval than '{eval_id}'.", param="run_ids")
    return [{"id": rid, "name": found[rid].name, "model": found[rid].model, "status": found[rid].status}
            for rid in ids]


def _load_items(session: Session, ids: list[str]) -> list[dict[str, Any]]:
    """The output items with only the parts of the trajectory the comparison reads (never its messages)."""
    o, t = EvalOutputItem, EvalOutputItem.trajectory
    stmt = (select(o.id, o.run_id, o.item_index, o.sample_index, o.status, o.results, o.datasource_item,
                   o.sample["usage"], t["tool_calls"], t["wall_time_s"], t["completion_tokens"], t["tool_output_tokens"])
            .where(o.run_id.in_(ids)).order_by(o.run_id, o.item_index, o.sample_index))
    rows = []
    for r in session.execute(stmt):
        parts = {"tool_calls": r[8], "wall_time_s": r[9], "completion_tokens": r[10], "tool_output_tokens": r[11]}
        rows.append({"id": r[0], "run_id": r[1], "item_index": r[2], "sample_index": r[3], "status": r[4],
                     "results": r[5], "datasource_item": r[6], "sample": {"usage": r[7]},
                     "trajectory": parts if any(v is not None for v in parts.values()) else None})
    return rows


def compare_runs(*, session: Session, project_id: str, eval_id: str, run_ids: list[str],
                 baseline_run_id: str | None = None) -> dict[str, Any]:
    """`compare` over the stored rows of the project's eval `eval_id`. 404 for an eval or run not
    in the project; 400 for fewer than 2 distinct runs, more than MAX_RUNS, a run of another eval
    or a baseline that is not one of the runs. Errors name the API's query parameters (`run_ids`,
    `baseline`)."""
    found = eval_row(session, project_id, eval_id)
    ids = _run_ids(run_ids)
    _check_request(ids, baseline_run_id)
    runs = _load_runs(session, project_id, eval_id, ids)
    return compare(eval_row={"id": found.id, "testing_criteria": found.testing_criteria}, runs=runs,
                   items=_load_items(session, ids), baseline_run_id=baseline_run_id)


# --- text and CSV -------------------------------------------------------------------------------

def _fmt(value: float | None, digits: int = 3, std: float | None = None) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def _tools(comparison: dict[str, Any]) -> list[str]:
    return sorted({t for run in comparison["runs"] for t in run["tool_calls_by_tool"]})


def _clip(text: str, width: int = 40) -> str:
    """A long name (an `ft:` model's) cut in the middle, so that a column stays readable."""
    return text if len(text) <= width else f"{text[:width // 2 - 1]}…{text[-(width // 2):]}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_comparison(comparison: dict[str, Any]) -> str:
    """A plain-text table, one column per run: the measures with their spreads, tool calls per
    tool, then how the items of each other run moved against the baseline (quadrant counts)."""
    runs, baseline = comparison["runs"], comparison["baseline_run_id"]
    rows = [["", *[(r["name"] or r["id"]) + (" (baseline)" if r["id"] == baseline else "") for r in runs]],
            ["run", *[r["id"] for r in runs]], ["model", *[_clip(r["model"] or "—") for r in runs]],
            ["status", *[r["status"] for r in runs]],
            ["items / samples", *[f"{r['items']} / {r['samples']}" for r in runs]],
            ["errored", *[str(r["errored"]) for r in runs]],
            ["mean reward ± std", *[_fmt(r["mean_reward"], 3, r["reward_std"]) for r in runs]],
            ["pass rate", *[_pct(r["pass_rate"]) for r in runs]],
            ["seconds per item ± std", *[_fmt(r["seconds_mean"], 2, r["seconds_std"]) for r in runs]],
            ["tokens per item ± std", *[_fmt(r["tokens_mean"], 1, r["tokens_std"]) for r in runs]],
            ["tool calls per item ± std", *[_fmt(r["tool_calls_mean"], 2, r["tool_calls_std"]) for r in runs]]]
    rows += [[f"  {tool}", *[_fmt(r["tool_calls_by_tool"].get(tool), 2) for r in runs]] for tool in _tools(comparison)]
    rows += [[f"pass rate: {c}", *[_pct(r["pass_rate_by_criterion"].get(c)) for r in runs]]
             for c in comparison["criteria"]]
    text = _table(rows)
    others = [r for r in runs if r["id"] != baseline]
    if others:
        base_name = next(r["name"] or r["id"] for r in runs if r["id"] == baseline)
        moved = [[f"items against {base_name}", *[r["name"] or r["id"] for r in others]]]
        moved += [[label, *[str(comparison["quadrants"][r["id"]][label]) for r in others]] for label in QUADRANTS]
        text += "\n\n" + _table(moved)
    return text + "\n"


RUN_MEASURES = ("items", "samples", "errored", "mean_reward", "reward_std", "pass_rate", "seconds_mean", "seconds_std",
                "tokens_mean", "tokens_std", "tool_calls_mean", "tool_calls_std")
ITEM_MEASURES = ("reward", "tool_calls", "seconds", "tokens")


def _cell(value: Any) -> Any:
    return "" if value is None else value


def comparison_csv(comparison: dict[str, Any], *, per_item: bool = False) -> str:
    """CSV of the comparison: one row per run (its measures, tool calls per tool, pass rate per
    criterion, and for the other runs the quadrant counts against the baseline), or with
    `per_item` one row per item (item_index; each run's reward, tool calls, seconds and tokens;
    each other run's deltas and quadrant). Columns of a run are prefixed with its id."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    (_item_rows if per_item else _run_rows)(writer, comparison)
    return out.getvalue()


def _run_rows(writer: Any, comparison: dict[str, Any]) -> None:
    tools, criteria = _tools(comparison), comparison["criteria"]
    writer.writerow(["run_id", "name", "model", "status", "baseline", *RUN_MEASURES,
                     *[f"tool_calls:{t}" for t in tools], *[f"pass_rate:{c}" for c in criteria], *QUADRANTS])
    for run in comparison["runs"]:
        counts = comparison["quadrants"].get(run["id"], {})
        writer.writerow([run["id"], run["name"], run["model"], run["status"], run["id"] == comparison["baseline_run_id"],
                         *[_cell(run[m]) for m in RUN_MEASURES],
                         *[_cell(run["tool_calls_by_tool"].get(t)) for t in tools],
                         *[_cell(run["pass_rate_by_criterion"].get(c)) for c in criteria],
                         *[_cell(counts.get(label)) for label in QUADRANTS]])


def _item_rows(writer: Any, comparison: dict[str, Any]) -> None:
    ids = [r["id"] for r in comparison["runs"]]
    others = [rid for rid in ids if rid != comparison["baseline_run_id"]]
    writer.writerow(["item_index", *[f"{rid}:{m}" for rid in ids for m in ITEM_MEASURES],
                     *[f"{rid}:{m}" for rid in others for m in ("reward_delta", "tool_calls_delta", "quadrant")]])
    for item in comparison["items"]:
        runs, deltas = item["runs"], item["deltas"]
        writer.writerow([item["item_index"], *[_cell(runs.get(rid, {}).get(m)) for rid in ids for m in ITEM_MEASURES],
                         *[_cell(deltas.get(rid, {}).get(k)) for rid in others for k in ("reward", "tool_calls", "quadrant")]])
