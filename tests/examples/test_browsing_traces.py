"""Browsing traces for the supervised warm start (examples/financial_reports/traces.py): written
against the real tool server, valid supervised rows, of varied length, ending with the right
figure, and rendered for training exactly as a rollout would render them."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.jobs.validation import check_supervised_row
from examples.financial_reports import demo_task
from examples.financial_reports.server import create_app
from examples.financial_reports.traces import BROWSING_PROMPT, browsing_traces
from tests.conftest import serve_app
from workers.models.loading import load_tokenizer
from workers.engine.prompting import ChatFormatter
from workers.engine.tools_client import ToolClient
from workers.methods.supervised.data import render_example


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """(training questions, two traces per question), written against the real tool server."""
    tmp_path = tmp_path_factory.mktemp("traces")
    corpus, train, _ = demo_task.build(tmp_path / "task", seed=1, companies=4, years=[2022, 2023],
                                       held_out_companies=1, system_prompt=BROWSING_PROMPT)
    with serve_app(create_app(corpus, index_cache_dir=tmp_path / "index")) as port:
        async def go() -> list[dict]:
            tools = [{"name": name, "server_url": f"http://127.0.0.1:{port}/tools"} for name in ("search", "list", "cat")]
            async with ToolClient(tools, allowlist=["127.0.0.1"]) as client:
                return await browsing_traces(train, client, seed=0, per_row=2)

        return train, asyncio.run(go())


def test_traces_browse_the_real_tool_server_and_end_with_the_right_figure(traces: tuple[list[dict], list[dict]]):
    rows, written = traces
    assert len(written) == 2 * len(rows)
    calls_per_trace, recoveries = [], 0
    for row, trace in zip([r for r in rows for _ in range(2)], written):
        check_supervised_row(trace)  # what a supervised job's file accepts
        messages = trace["messages"]
        assert messages[:2] == row["messages"]
        calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) | {"tool": m["tool_calls"][0]["function"]["name"]}
                 for m in messages if m.get("tool_calls")]
        outputs = [m["content"] for m in messages if m["role"] == "tool"]
        calls_per_trace.append(len(calls))
        for number, (call, output) in enumerate(zip(calls, outputs)):
            if call.get("path"):  # every path was printed by an earlier tool: read, never guessed
                folder, _, name = call["path"].rpartition("/")
                assert any(name in earlier and (not folder or folder.split("/")[0] in earlier)
                           for earlier in outputs[:number]), (call, outputs[:number])
            if call["tool"] == "cat" and call["path"] == row["document"]:
                assert output.startswith("# ") and row["company"] in output  # the report itself, its opening
            if output.startswith("error"):  # a mistake is followed by something else, never repeated
                recoveries += 1
                assert calls[number + 1] != call
        assert calls[-1]["tool"] == "search" or calls[-1]["path"] == row["document"]  # the answer's source was read
        assert messages[-1] == {"role": "assistant", "content": messages[-1]["content"]}
        assert row["answer"] in messages[-1]["content"]
    assert min(calls_per_trace) >= 1 and max(calls_per_trace) >= 4
    assert len(set(calls_per_trace)) >= 3  # lengths vary: reinforcement has a spread to learn from
    assert recoveries >= 1


def test_a_trace_trains_on_its_calls_and_answer_as_a_rollout_writes_them(traces: tuple[list[dict], list[dict]]):
    _, written = traces
    formatter = ChatFormatter(load_tokenizer("tiny-smollm2"))
    ids, mask = render_example(formatter, written[0])
    learned = formatter.decode([t for t, m in zip(ids, mask) if m])
    calls = [m for m in written[0]["messages"] if m.get("tool_calls")]
    assert learned.count("<tool_call>") == len(calls) and learned.endswith(written[0]["messages"][-1]["content"] + "<|im_end|>")
    assert "<tool_response>" not in learned  # the tools' outputs are context, never learned
