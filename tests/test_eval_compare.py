"""Comparing an eval's runs item by item (app/evals/compare.py): the pure computation on hand-built
rows (means and population spreads, deltas, every quadrant label, items one run lacks, errored
items), the text table and CSV, and compare_runs over the real PostgreSQL database, scoped to
the project (another project's run is not found; one run or a run of another eval is a 400)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from app.core.config import Settings
from app.core.db import make_engine, make_session_factory
from app.core.errors import APIError
from app.evals.compare import QUADRANTS, compare, compare_runs, comparison_csv, format_comparison, quadrant
from app.core.migrations import upgrade
from app.evals.models import Eval, EvalOutputItem, EvalRun
from app.evals.service import refresh_result
from tests.conftest import make_project

CRITERIA = [{"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
             "reference": "{{item.answer}}", "operation": "eq"},
            {"type": "python", "name": "short", "source": "def grade(sample, item): return 1.0"}]
EVAL = {"id": "eval_1", "testing_criteria": CRITERIA}


def trajectory(tools: list[str], *, seconds: float = 1.0, completion: int = 10, tool_output: int = 5,
               answer: str = "42", question: str = "q") -> dict[str, Any]:
    """A rollout record as workers/engine/rollout.py's RolloutRecord.summary() gives it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer with a number."},
                                      {"role": "user", "content": question}]
    calls = []
    for n, name in enumerate(tools):
        call_id = f"call_{uuid.uuid4().hex[:8]}"
        arguments = json.dumps({"query": f"{name} {n}"})
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": f"{name} says {n}"})
        calls.append({"call_id": call_id, "name": name, "arguments": arguments, "status": "ok", "status_code": 200,
                      "latency_s": 0.01, "bytes": 9, "error": None, "turn": n + 1})
    messages.append({"role": "assistant", "content": answer})
    return {"trace_id": f"trace_{uuid.uuid4().hex[:8]}", "sample_index": 0, "messages": messages, "tool_calls": calls,
            "prompt_tokens": 20, "completion_tokens": completion, "tool_output_tokens": tool_output,
            "turns": len(tools) + 1, "parse_errors": 0, "wall_time_s": seconds, "finish_reason": "answered",
            "final_answer": answer, "output_json": None}


def item(run_id: str, index: int, score: float | None, tools: list[str] | None = None, *, sample: int = 0,
         status: str | None = None, seconds: float = 1.0, completion: int = 10, tool_output: int = 5,
         answer: str = "42", with_trajectory: bool = True, short: bool = True) -> dict[str, Any]:
    """An output item row as compare() reads it: the first criterion scores `score`."""
    status = status or ("error" if score is None else "pass" if score >= 1 else "fail")
    results = [{"name": "exact", "type": "string_check", "score": score, "passed": status == "pass"},
               {"name": "short", "type": "python", "score": 1.0 if short else 0.0, "passed": short}]
    if score is None:
        results[0]["error"] = "grader_server_error"
    return {"id": f"outputitem_{run_id}_{index}_{sample}", "run_id": run_id, "item_index": index, "sample_index": sample,
            "status": status, "results": results, "datasource_item": {"question": f"q{index}", "answer": "42"},
            "sample": {"input": [{"role": "user", "content": f"q{index}"}], "output": [{"role": "assistant", "content": answer}],
                       "finish_reason": "stop", "model": "m", "usage": {"prompt_tokens": 20, "completion_tokens": 7,
                                                                        "total_tokens": 27, "cached_tokens": 0}},
            "trajectory": trajectory(tools or [], seconds=seconds, completion=completion, tool_output=tool_output,
                                     answer=answer, question=f"q{index}") if with_trajectory else None}


def runs(*ids: str) -> list[dict[str, Any]]:
    return [{"id": rid, "name": f"name-{rid}", "model": f"model-{rid}", "status": "succeeded"} for rid in ids]


def run_of(comparison: dict[str, Any], run_id: str) -> dict[str, Any]:
    return next(r for r in comparison["runs"] if r["id"] == run_id)


# --- the pure computation -----------------------------------------------------------------------

def test_run_measures_are_means_over_samples_with_population_spreads():
    rows = [item("a", 0, 1.0, ["search", "search"], seconds=1.0, completion=10, tool_output=20),
            item("a", 1, 0.0, ["search"], seconds=2.0, completion=20, tool_output=0, short=False),
            item("a", 2, 1.0, ["cat"], seconds=3.0, completion=30, tool_output=10),
            item("b", 0, 1.0, [], seconds=0.5)]
    c = compare(eval_row=EVAL, runs=runs("a", "b"), items=rows)
    assert c["object"] == "eval.comparison" and c["eval_id"] == "eval_1" and c["baseline_run_id"] == "a"
    assert c["criteria"] == ["exact", "short"]
    a = run_of(c, "a")
    assert (a["name"], a["model"], a["status"]) == ("name-a", "model-a", "completed")  # OpenAI's word
    assert (a["items"], a["samples"], a["errored"]) == (3, 3, 0)
    assert a["mean_reward"] == pytest.approx(2 / 3)
    assert a["reward_std"] == pytest.approx(math.sqrt(2 / 9))  # population: divided by n
    assert a["pass_rate"] == pytest.approx(2 / 3)
    assert (a["seconds_mean"], a["seconds_std"]) == (pytest.approx(2.0), pytest.approx(math.sqrt(2 / 3)))
    assert a["tokens_mean"] == pytest.approx(30.0)  # completion + tool output: 30, 20, 40
    assert a["tokens_std"] == pytest.approx(math.sqrt(200 / 3))
    assert (a["tool_calls_mean"], a["tool_calls_std"]) == (pytest.approx(4 / 3), pytest.approx(math.sqrt(2 / 9)))
    assert a["tool_calls_by_tool"] == {"cat": pytest.approx(1 / 3), "search": pytest.approx(1.0)}
    assert a["pass_rate_by_criterion"] == {"exact": pytest.approx(2 / 3), "short": pytest.approx(2 / 3)}
    b = run_of(c, "b")
    assert b["reward_std"] == 0.0 and b["seconds_std"] == 0.0  # one sample
    assert b["tool_calls_by_tool"] == {"cat": 0.0, "search": 0.0}  # every tool any run called
    json.dumps(c, allow_nan=False)  # JSON as it is


def test_every_quadrant_label_and_its_count():
    """The baseline scores 0.5 with 2 tool calls on every item; the other run moves each item into
    another quadrant."""
    moves = {0: (1.0, 1, "improved reward & fewer tools"), 1: (1.0, 3, "improved reward & more tools"),
             2: (1.0, 2, "improved reward & same tools"), 3: (0.0, 1, "worse reward & fewer tools"),
             4: (0.0, 3, "worse reward & more tools"), 5: (0.0, 2, "worse reward & same tools"),
             6: (0.5, 5, "same reward")}
    rows = [item("base", i, 0.5, ["search", "cat"]) for i in moves]
    rows += [item("ft", i, score, ["search"] * tools) for i, (score, tools, _) in moves.items()]
    c = compare(eval_row=EVAL, runs=runs("base", "ft"), items=rows)
    for entry in c["items"]:
        score, tools, label = moves[entry["item_index"]]
        delta = entry["deltas"]["ft"]
        assert delta == {"reward": pytest.approx(score - 0.5), "tool_calls": pytest.approx(tools - 2), "quadrant": label}
        assert list(entry["deltas"]) == ["ft"]  # no delta of the baseline against itself
    assert c["quadrants"] == {"ft": dict.fromkeys(QUADRANTS, 1)}
    assert set(QUADRANTS) == {label for _, _, label in moves.values()}


def test_quadrant_edges():
    assert quadrant(0.0, -3.0) == "same reward"
    assert quadrant(0.1, 0.0) == "improved reward & same tools"
    assert quadrant(-0.1, -0.5) == "worse reward & fewer tools"
    assert quadrant(None, 1.0) is None and quadrant(1.0, None) is None
    # float noise of means is no change: (0.1 + 0.2) against 0.3
    rows = [item("a", 0, 0.3, ["x"]), item("b", 0, 0.1, ["x"]), item("b", 0, 0.5, ["x"], sample=1)]
    c = compare(eval_row=EVAL, runs=runs("a", "b"), items=rows)
    assert c["items"][0]["deltas"]["b"]["reward"] == 0.0 and c["items"][0]["deltas"]["b"]["quadrant"] == "same reward"


def test_items_missing_in_one_run_have_no_delta_and_are_not_counted():
    rows = [item("a", 0, 0.0, ["s"]), item("a", 1, 0.0, ["s"]), item("b", 0, 1.0, []), item("b", 2, 1.0, [])]
    c = compare(eval_row=EVAL, runs=runs("a", "b"), items=rows)
    by_index = {i["item_index"]: i for i in c["items"]}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[0]["deltas"] == {"b": {"reward": 1.0, "tool_calls": -1.0, "quadrant": "improved reward & fewer tools"}}
    assert by_index[1]["deltas"] == {} and list(by_index[1]["runs"]) == ["a"]
    assert by_index[2]["deltas"] == {} and list(by_index[2]["runs"]) == ["b"]
    assert sum(c["quadrants"]["b"].values()) == 1
    assert run_of(c, "a")["items"] == 2 and run_of(c, "b")["items"] == 2


def test_errored_items_are_counted_and_left_out_of_the_reward():
    rows = [item("a", 0, 1.0, ["s"]), item("a", 1, 0.0, ["s"]),
            item("b", 0, None, ["s", "s"]), item("b", 1, 1.0, [])]
    c = compare(eval_row=EVAL, runs=runs("a", "b"), items=rows)
    b = run_of(c, "b")
    assert b["errored"] == 1 and b["samples"] == 2
    assert b["mean_reward"] == 1.0 and b["reward_std"] == 0.0  # over the graded sample only
    assert b["pass_rate"] == 0.5  # an errored sample did not pass
    assert b["pass_rate_by_criterion"]["exact"] == 0.5
    first = c["items"][0]
    assert first["runs"]["b"]["reward"] is None and first["runs"]["b"]["pass_rate"] == 0.0
    assert first["deltas"]["b"] == {"reward": None, "tool_calls": 1.0, "quadrant": None}
    assert c["quadrants"]["b"]["improved reward & fewer tools"] == 1 and sum(c["quadrants"]["b"].values()) == 1
    assert run_of(c, "a")["errored"] == 0


def test_samples_of_an_item_are_averaged_and_listed():
    rows = [item("a", 0, 0.0, ["s"]), item("b", 0, 1.0, ["s", "s"], sample=1), item("b", 0, 0.0, [], sample=0)]
    c = compare(eval_row=EVAL, runs=runs("a", "b"), items=rows)
    per_run = c["items"][0]["runs"]["b"]
    assert per_run == {"reward": 0.5, "pass_rate": 0.5, "tool_calls": 1.0, "seconds": 1.0, "tokens": 15.0,
                       "output_item_ids": ["outputitem_b_0_0", "outputitem_b_0_1"]}
    assert c["items"][0]["deltas"]["b"]["quadrant"] == "improved reward & same tools"
    assert c["items"][0]["datasource_item"] == {"question": "q0", "answer": "42"}
    b = run_of(c, "b")
    assert (b["items"], b["samples"]) == (1, 2)


def test_a_named_baseline_and_three_runs():
    rows = [item("a", 0, 0.0, ["s"]), item("b", 0, 1.0, ["s", "s"]), item("c", 0, 0.5, [])]
    c = compare(eval_row=EVAL, runs=runs("a", "b", "c"), items=rows, baseline_run_id="b")
    assert c["baseline_run_id"] == "b" and [r["id"] for r in c["runs"]] == ["a", "b", "c"]
    assert c["items"][0]["deltas"] == {
        "a": {"reward": -1.0, "tool_calls": -1.0, "quadrant": "worse reward & fewer tools"},
        "c": {"reward": -0.5, "tool_calls": -2.0, "quadrant": "worse reward & fewer tools"}}
    assert set(c["quadrants"]) == {"a", "c"}


def test_a_run_without_trajectories_counts_no_tools_and_the_samples_tokens():
    rows = [item("a", 0, 1.0, with_trajectory=False), item("b", 0, 1.0, ["s"])]
    a = run_of(compare(eval_row=EVAL, runs=runs("a", "b"), items=rows), "a")
    assert a["tool_calls_mean"] == 0.0 and a["seconds_mean"] is None and a["seconds_std"] is None
    assert a["tokens_mean"] == 7.0  # sample.usage.completion_tokens


def test_criteria_names_are_unique():
    criteria = [{"type": "string_check", "name": "exact"}, {"type": "string_check", "name": "exact"}, {"type": "python"}]
    c = compare(eval_row={"id": "e", "testing_criteria": criteria}, runs=runs("a", "b"), items=[])
    assert c["criteria"] == ["exact", "exact (2)", "python"]
    assert run_of(c, "a")["mean_reward"] is None and run_of(c, "a")["pass_rate"] is None


# --- text and CSV -------------------------------------------------------------------------------

def sample_comparison() -> dict[str, Any]:
    rows = [item("base", 0, 0.0, ["search", "search"], seconds=2.0), item("base", 1, 1.0, ["search"], seconds=4.0),
            item("ft", 0, 1.0, ["search"], seconds=1.0), item("ft", 1, 1.0, ["cat", "cat"], seconds=1.0)]
    return compare(eval_row=EVAL, runs=runs("base", "ft"), items=rows)


def test_format_comparison_is_a_table_with_one_column_per_run():
    text = format_comparison(sample_comparison())
    lines = text.splitlines()
    assert "name-base (baseline)" in lines[0] and "name-ft" in lines[0]
    row = {re.split(r"\s{2,}", line.strip())[0]: line for line in lines if line.strip()}
    assert row["mean reward ± std"].split()[-6:] == ["0.500", "±", "0.500", "1.000", "±", "0.000"]
    assert row["pass rate"].split()[-2:] == ["50.0%", "100.0%"]
    assert row["seconds per item ± std"].split()[-6:] == ["3.00", "±", "1.00", "1.00", "±", "0.00"]
    assert row["tool calls per item ± std"].split()[-6:] == ["1.50", "±", "0.50", "1.50", "±", "0.50"]
    assert row["search"].split()[-2:] == ["1.50", "0.50"] and row["cat"].split()[-2:] == ["0.00", "1.00"]
    assert "items against name-base" in text
    assert row["improved reward & fewer tools"].split()[-1] == "1"
    assert row["same reward"].split()[-1] == "1"


def test_comparison_csv_per_run_and_per_item():
    comparison = sample_comparison()
    per_run = list(csv.DictReader(io.StringIO(comparison_csv(comparison))))
    assert [r["run_id"] for r in per_run] == ["base", "ft"]
    assert per_run[0]["baseline"] == "True" and float(per_run[0]["mean_reward"]) == 0.5
    assert float(per_run[1]["tool_calls:cat"]) == 1.0 and float(per_run[1]["pass_rate:exact"]) == 1.0
    assert per_run[0]["same reward"] == "" and per_run[1]["same reward"] == "1"
    per_item = list(csv.DictReader(io.StringIO(comparison_csv(comparison, per_item=True))))
    assert [r["item_index"] for r in per_item] == ["0", "1"]
    assert per_item[0]["base:reward"] == "0.0" and per_item[0]["ft:tool_calls"] == "1.0"
    assert per_item[0]["ft:reward_delta"] == "1.0" and per_item[0]["ft:tool_calls_delta"] == "-1.0"
    assert per_item[0]["ft:quadrant"] == "improved reward & fewer tools"
    assert per_item[1]["ft:quadrant"] == "same reward" and per_item[1]["base:seconds"] == "4.0"
    assert "base:reward_delta" not in per_item[0]


# --- over the database --------------------------------------------------------------------------

def seed_comparison(settings: Any, project_id: str) -> dict[str, Any]:
    """An eval with a base run and a fine-tuned run over 3 items (one sample each), stored through
    the models: the base model searches and often misses, the fine-tuned one reads the file."""
    suffix = uuid.uuid4().hex[:8]
    ids = {"eval": f"eval_{suffix}", "base": f"evalrun_base_{suffix}", "ft": f"evalrun_ft_{suffix}"}
    plan = {  # item: (base score, base tools, base answer, ft score, ft tools, ft answer)
        0: (0.0, ["search", "search", "search"], "41", 1.0, ["search", "cat"], "42"),
        1: (1.0, ["search"], "42", 1.0, ["cat"], "42"),
        2: (1.0, ["search", "cat"], "42", 0.0, ["search", "cat", "cat"], "40"),
    }
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine).begin() as session:
            session.add(Eval(id=ids["eval"], project_id=project_id, name="revenue questions",
                             data_source_config={"type": "custom", "item_schema": {"type": "object"}},
                             testing_criteria=CRITERIA))
            session.flush()
            for key, name, model in (("base", "base model", "tiny-smollm2"), ("ft", "step 40", "ft:tiny-smollm2:step-40")):
                session.add(EvalRun(id=ids[key], eval_id=ids["eval"], project_id=project_id, name=name, model=model,
                                    data_source={"type": "completions"}, status="succeeded", items_total=3))
            session.flush()
            for index, (bs, bt, ba, fs, ft, fa) in plan.items():
                for key, score, tools, answer, seconds in (("base", bs, bt, ba, 3.0), ("ft", fs, ft, fa, 1.5)):
                    row = item(ids[key], index, score, tools, answer=answer, seconds=seconds)
                    session.add(EvalOutputItem(
                        id=f"outputitem_{key}_{index}_{suffix}", run_id=ids[key], eval_id=ids["eval"], item_index=index,
                        sample_index=0, trace_id=row["trajectory"]["trace_id"], status=row["status"],
                        datasource_item=row["datasource_item"], results=row["results"], sample=row["sample"],
                        trajectory=row["trajectory"]))
            for key in ("base", "ft"):  # the counts the control plane keeps with every push of items
                refresh_result(session, session.scalars(select(EvalRun).where(EvalRun.id == ids[key])).one())
    finally:
        engine.dispose()
    return ids


@pytest.fixture
def session(settings):  # noqa: ANN001, ANN201
    engine = make_engine(settings.resolved_database_url)
    with make_session_factory(engine)() as s:
        yield s
    engine.dispose()


def test_compare_runs_reads_the_stored_rows(settings, project, session):
    ids = seed_comparison(settings, project["project_id"])
    c = compare_runs(session=session, project_id=project["project_id"], eval_id=ids["eval"],
                     run_ids=[ids["base"], ids["ft"], ids["base"]])  # a repeated run counts once
    assert c["baseline_run_id"] == ids["base"] and c["criteria"] == ["exact", "short"]
    base, ft = run_of(c, ids["base"]), run_of(c, ids["ft"])
    assert (base["name"], base["model"], base["status"]) == ("base model", "tiny-smollm2", "completed")
    assert base["mean_reward"] == pytest.approx(2 / 3) and ft["mean_reward"] == pytest.approx(2 / 3)
    assert base["seconds_mean"] == 3.0 and ft["seconds_mean"] == 1.5 and base["tokens_mean"] == 15.0
    assert base["tool_calls_mean"] == 2.0 and ft["tool_calls_mean"] == 2.0
    assert ft["tool_calls_by_tool"] == {"cat": pytest.approx(4 / 3), "search": pytest.approx(2 / 3)}
    assert [i["deltas"][ids["ft"]]["quadrant"] for i in c["items"]] == [
        "improved reward & fewer tools", "same reward", "worse reward & more tools"]
    assert c["items"][0]["runs"][ids["ft"]]["output_item_ids"] == [f"outputitem_ft_0_{ids['eval'][5:]}"]
    assert c["items"][0]["datasource_item"] == {"question": "q0", "answer": "42"}
    assert c["quadrants"][ids["ft"]]["improved reward & fewer tools"] == 1
    json.dumps(c, allow_nan=False)
    named = compare_runs(session=session, project_id=project["project_id"], eval_id=ids["eval"],
                         run_ids=[ids["base"], ids["ft"]], baseline_run_id=ids["ft"])
    assert named["items"][0]["deltas"][ids["base"]]["quadrant"] == "worse reward & more tools"


def refused(session: Any, project_id: str, eval_id: str, run_ids: list[str], **kw: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        compare_runs(session=session, project_id=project_id, eval_id=eval_id, run_ids=run_ids, **kw)
    return caught.value


def test_compare_runs_is_scoped_to_the_project_and_checks_the_request(settings, project, session):
    ids = seed_comparison(settings, project["project_id"])
    other = make_project(settings)
    theirs = seed_comparison(settings, other["project_id"])
    mine, pair = project["project_id"], [ids["base"], ids["ft"]]
    # Another project's eval or run: not found, as an unknown one.
    error = refused(session, mine, theirs["eval"], [theirs["base"], theirs["ft"]])
    assert (error.status_code, error.code, error.param) == (404, "eval_not_found", "eval_id")
    error = refused(session, mine, ids["eval"], [ids["base"], theirs["ft"]])
    assert (error.status_code, error.code, error.param) == (404, "eval_run_not_found", "run_ids")
    assert theirs["ft"] in error.message
    assert refused(session, mine, ids["eval"], [ids["base"], "evalrun_nope"]).status_code == 404
    # One run (or the same run twice): 400.
    for run_ids in ([ids["base"]], [ids["base"], ids["base"]], []):
        error = refused(session, mine, ids["eval"], run_ids)
        assert (error.status_code, error.param) == (400, "run_ids") and "at least 2" in error.message
    assert refused(session, mine, ids["eval"], [f"evalrun_{n}" for n in range(11)]).status_code == 400
    error = refused(session, mine, ids["eval"], pair, baseline_run_id="evalrun_other")
    assert (error.status_code, error.param) == (400, "baseline")
    # A run of another eval of the same project.
    second = seed_comparison(settings, mine)
    error = refused(session, mine, ids["eval"], [ids["base"], second["ft"]])
    assert error.status_code == 400 and "another eval" in error.message


def test_compare_runs_on_sqlite(tmp_path, monkeypatch):
    """The embedded default: the same JSON paths read from SQLite."""
    for var in ("AGENT_RFT_DATABASE_URL", "AGENT_RFT_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings(_env_file=None, data_dir=tmp_path, outbound_allowlist=["127.0.0.1"])
    upgrade(settings.resolved_database_url)
    project_id = make_project(settings)["project_id"]
    ids = seed_comparison(settings, project_id)
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_session_factory(engine)() as session:
            c = compare_runs(session=session, project_id=project_id, eval_id=ids["eval"], run_ids=[ids["base"], ids["ft"]])
    finally:
        engine.dispose()
    assert run_of(c, ids["ft"])["tool_calls_by_tool"] == {"cat": pytest.approx(4 / 3), "search": pytest.approx(2 / 3)}
    assert run_of(c, ids["base"])["seconds_mean"] == 3.0 and run_of(c, ids["base"])["tokens_mean"] == 15.0
    assert [i["deltas"][ids["ft"]]["quadrant"] for i in c["items"]] == [
        "improved reward & fewer tools", "same reward", "worse reward & more tools"]
