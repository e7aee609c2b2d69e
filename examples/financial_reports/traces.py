"""Browsing traces for a supervised warm start: a scripted, thorough and wasteful policy answers
each question against the real tool server, and every step becomes OpenAI chat JSONL (assistant
`tool_calls`, `tool` results with the server's real output, the final answer).

The policy stands in for a prompted model that over-browses, the starting point of Agent RFT's
demo. Per question a seeded generator picks one of the strategies below. Each searches, then
browses on paths it reads off an earlier tool result (a search hit or a listing), never writes one
itself, and some go wrong on the way and recover (a `cat` on a folder, answered with an error, then
a `list` of it). So the agent learns to copy paths and to do something else after an error, and
traces differ in length (1 to 4 calls), which leaves reinforcement learning a spread to learn
from. The search result's snippet already holds the answer: the shortest correct path is one call.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from examples.financial_reports.server import TOOL_SCHEMAS

# The call syntax is shown once in the system message: a model shown it writes calls the parser
# reads, and the rollout engine then adds no generic tool instructions (fewer prompt tokens).
BROWSING_PROMPT = (
    "You answer questions about companies' annual reports with the tools search(query), "
    "list(path) and cat(path, limit). Call one tool per turn, e.g. "
    '<tool_call>{"name": "search", "arguments": {"query": "Acme Foods revenue 2023"}}</tool_call>, '
    "then answer in one sentence.")
CAT_LIMIT = 360  # characters a trace's `cat` reads: a report's title and opening paragraph, which quotes its figures


async def browsing_traces(rows: Sequence[dict[str, Any]], client: Any, *, seed: int, per_row: int = 1,
                          cat_limit: int = CAT_LIMIT) -> list[dict[str, Any]]:
    """`per_row` traces per question (rows of demo_task, system message included: company, year,
    document, answer, scale), their tool results fetched through `client` (a ToolClient on the
    tool server)."""
    traces = []
    for index, row in enumerate(rows):
        for copy in range(per_row):
            rng = random.Random(f"agent-rft/traces/{seed}/{index}/{copy}")
            strategy = rng.choices(list(STRATEGIES), weights=[weight for weight, _ in STRATEGIES.values()])[0]
            trace = _Trace(client, row, f"t{index}-{copy}", cat_limit)
            await STRATEGIES[strategy][1](trace)
            trace.messages.append({"role": "assistant", "content": answer_text(row)})
            traces.append({"messages": trace.messages, "tools": TOOL_SCHEMAS})
    return traces


def preference_pairs(traces: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """DPO rows (OpenAI's preference format) from browsing traces: once the first tool result is in,
    answering (the trace's final answer, which that result already supports) is preferred to
    browsing on (the trace's next call). A trace that answers right away gives no pair."""
    pairs = []
    for trace in traces:
        messages = trace["messages"]
        first_result = next(i for i, message in enumerate(messages) if message["role"] == "tool")
        browsing_on = messages[first_result + 1]
        if browsing_on.get("tool_calls"):
            pairs.append({"input": {"messages": messages[:first_result + 1], "tools": trace["tools"]},
                          "preferred_output": [messages[-1]], "non_preferred_output": [browsing_on]})
    return pairs


def tool_calls_of(trace: dict[str, Any]) -> int:
    return sum(1 for message in trace["messages"] if message.get("tool_calls"))


def answer_text(row: dict[str, Any]) -> str:
    question = row["messages"][-1]["content"]
    subject = question.removeprefix("What was ").removesuffix("?")
    return f"{subject} was ${row['answer']} {row['scale']}."


class _Trace:
    """One question's conversation, grown a tool call and its real result at a time."""

    def __init__(self, client: Any, row: dict[str, Any], trace_id: str, cat_limit: int) -> None:
        self.client, self.row, self.trace_id, self.cat_limit = client, row, trace_id, cat_limit
        self.messages: list[dict[str, Any]] = list(row["messages"])

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """One assistant turn calling `name`, and the tool's real output as the next message."""
        call_id = f"call_{sum(1 for m in self.messages if m.get('tool_calls')) + 1}"
        arguments_json = json.dumps(arguments)
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_json}}]})
        result = await self.client.call(trace_id=self.trace_id, call_id=call_id, name=name,
                                        arguments_json=arguments_json,
                                        item={k: v for k, v in self.row.items() if k != "messages"})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result.output})
        return result.output

    async def search(self, *, reworded: bool = False) -> list[str]:
        """Search for the question's company, line item and year; the hits' paths, best first."""
        item = self.row["messages"][-1]["content"].split("'s ", 1)[1].split(" in ")[0]
        query = (f"{self.row['year']} annual report of {self.row['company']}" if reworded
                 else f"{self.row['company']} {item} {self.row['year']}")
        output = await self.call("search", {"query": query})
        return re.findall(r"^(\S+\.md) — ", output, flags=re.MULTILINE)

    async def cat(self, path: str) -> str:
        return await self.call("cat", {"path": path, "limit": self.cat_limit})

    async def list(self, path: str) -> list[str]:
        """The listing's entries (folders end in '/')."""
        output = await self.call("list", {"path": path})
        return output.splitlines()[1:]

    async def browse_to_report(self) -> None:
        """List the top of the tree, then down to the report."""
        company = self.row["document"].split("/")[0]
        await self.list_down(_entry(await self.list(""), company + "/").rstrip("/"))

    async def list_down(self, company: str) -> None:
        """From the company's folder (as a tool printed it) to the report: its years, the year's
        files, the report; each path picked from the listing before it."""
        _, year, name = self.row["document"].split("/")
        years = await self.list(company)
        files = await self.list(f"{company}/{_entry(years, year + '/')}".rstrip("/"))
        await self.cat(f"{company}/{year}/{_entry(files, name)}")

    async def read_report(self, hits: list[str]) -> None:
        """Read the question's report: from the search hits when it is among them, else by listing."""
        if self.row["document"] in hits:
            await self.cat(self.row["document"])
        else:
            await self.browse_to_report()

    def other_year_hit(self, hits: list[str]) -> str | None:
        company = self.row["document"].split("/")[0]
        return next((h for h in hits if h.startswith(company + "/") and h != self.row["document"]), None)


def _entry(listing: list[str], wanted: str) -> str:
    """The listing's line for `wanted`: a path is only ever taken from what a tool printed."""
    if wanted not in listing:
        raise LookupError(f"{wanted!r} is not in the listing {listing}")
    return wanted


async def _search(trace: _Trace) -> None:
    await trace.search()


async def _search_cat(trace: _Trace) -> None:
    await trace.read_report(await trace.search())


async def _search_wrong_cat(trace: _Trace) -> None:
    hits = await trace.search()
    wrong = trace.other_year_hit(hits) or next((h for h in hits if h != trace.row["document"]), None)
    if wrong is not None:
        await trace.cat(wrong)
    await trace.read_report(hits)


async def _search_browse(trace: _Trace) -> None:
    """From a hit's company folder down to the report."""
    hits = await trace.search()
    company = trace.row["document"].split("/")[0]
    hit = next((h for h in hits if h.startswith(company + "/")), None)
    if hit is None:
        await trace.browse_to_report()
    else:
        await trace.list_down(hit.split("/")[0])


async def _search_recover(trace: _Trace) -> None:
    hits = await trace.search()
    if trace.row["document"] not in hits:
        await trace.browse_to_report()
        return
    folder, name = trace.row["document"].rsplit("/", 1)
    await trace.cat(folder)  # a folder, not a report: the server answers with an error
    files = await trace.list(folder)
    await trace.cat(f"{folder}/{_entry(files, name)}")


async def _search_twice(trace: _Trace) -> None:
    await trace.search()
    await trace.read_report(await trace.search(reworded=True))


async def _list_search_cat(trace: _Trace) -> None:
    await trace.list("")
    await trace.read_report(await trace.search())


# Strategies and how often the scripted policy takes each. Every one searches first: a small model
# copies a path from a search hit far more reliably than it finds a company's folder in a listing.
STRATEGIES: dict[str, tuple[float, Callable[[_Trace], Awaitable[None]]]] = {
    "search": (0.10, _search),                      # search, answer
    "search_cat": (0.20, _search_cat),              # search, read the report, answer
    "search_wrong_cat": (0.20, _search_wrong_cat),  # search, read the other year's report first, then the right one
    "search_browse": (0.15, _search_browse),        # search, list the company's folder and the year's, read the report
    "search_recover": (0.15, _search_recover),      # search, cat the report's folder (an error), list it, read the report
    "search_twice": (0.10, _search_twice),          # search, search again in other words, read the report
    "list_search_cat": (0.10, _list_search_cat),    # list the top, search, read the report
}
