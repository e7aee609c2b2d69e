"""Browsing traces for a supervised warm start: a scripted, thorough and wasteful policy answers
each question against the real tool server, and every step becomes OpenAI chat JSONL (assistant
`tool_calls`, `tool` results with the server's real output, the final answer).

The policy stands in for a prompted model that over-browses, the starting point of Agent RFT's
demo: it lists the top of the tree, then the company's folder, searches, reads a report (now and
then the other year's first), and answers. Each step is drawn per question from a seeded
generator, so traces differ in length (2 to 5 calls) and order, which leaves reinforcement
learning a spread to learn from. The search result's snippet already holds the answer: the
shortest correct path is one call.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from examples.financial_reports.server import TOOL_SCHEMAS

BROWSING_PROMPT = ("You answer questions about companies' annual reports. Look the figures up with the tools, "
                   "then answer in one sentence.")
CAT_LIMIT = 1200  # characters a trace's `cat` reads: the opening of a report, where its figures are quoted
# How often the scripted policy takes each optional step.
LIST_TOP, LIST_COMPANY, READ_OTHER_YEAR_FIRST, READ_REPORT = 0.6, 0.7, 0.35, 0.8


async def browsing_traces(rows: Sequence[dict[str, Any]], client: Any, *, seed: int, per_row: int = 1,
                          cat_limit: int = CAT_LIMIT) -> list[dict[str, Any]]:
    """`per_row` traces per question (rows of demo_task, system message included: company, year,
    document, answer, scale), their tool results fetched through `client` (a ToolClient on the
    tool server)."""
    traces = []
    for index, row in enumerate(rows):
        for copy in range(per_row):
            rng = random.Random(f"agent-rft/traces/{seed}/{index}/{copy}")
            messages: list[dict[str, Any]] = list(row["messages"])
            for number, (name, arguments) in enumerate(browsing_plan(row, rng, cat_limit), start=1):
                await _call(client, messages, row, f"t{index}-{copy}", f"call_{number}", name, arguments)
            messages.append({"role": "assistant", "content": answer_text(row)})
            traces.append({"messages": messages, "tools": TOOL_SCHEMAS})
    return traces


def browsing_plan(row: dict[str, Any], rng: random.Random,
                  cat_limit: int = CAT_LIMIT) -> list[tuple[str, dict[str, Any]]]:
    """The calls of one trace: optional lists, a search, optional reads, in that order."""
    company_dir, year = row["document"].split("/")[0], row["year"]
    item = row["messages"][-1]["content"].split("'s ", 1)[1].split(" in ")[0]
    plan: list[tuple[str, dict[str, Any]]] = []
    if rng.random() < LIST_TOP:
        plan.append(("list", {"path": ""}))
    if rng.random() < LIST_COMPANY:
        plan.append(("list", {"path": company_dir}))
    plan.append(("search", {"query": f"{row['company']} {item} {year}"}))
    if rng.random() < READ_OTHER_YEAR_FIRST:
        other = str(int(year) - 1) if year.endswith("3") else str(int(year) + 1)
        plan.append(("cat", {"path": row["document"].replace(f"/{year}/", f"/{other}/"), "limit": cat_limit}))
    if rng.random() < READ_REPORT or len(plan) == 1:
        plan.append(("cat", {"path": row["document"], "limit": cat_limit}))
    return plan


def answer_text(row: dict[str, Any]) -> str:
    question = row["messages"][-1]["content"]
    subject = question.removeprefix("What was ").removesuffix("?")
    return f"{subject} was ${row['answer']} {row['scale']}."


async def _call(client: Any, messages: list[dict[str, Any]], row: dict[str, Any], trace_id: str, call_id: str,
                name: str, arguments: dict[str, Any]) -> None:
    """One assistant turn calling `name`, and the tool's real output as the next message."""
    arguments_json = json.dumps(arguments)
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_json}}]})
    result = await client.call(trace_id=trace_id, call_id=call_id, name=name, arguments_json=arguments_json,
                               item={k: v for k, v in row.items() if k != "messages"})
    messages.append({"role": "tool", "tool_call_id": call_id, "content": result.output})
