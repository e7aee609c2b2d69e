"""The financial-reports demo: the synthetic corpus (answers recomputed from the rendered tables),
the TAT-QA loader on the shared data, the tool server through the service's real ToolClient, and the
endpoint grader reading the tool server's per-trace log."""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from examples.financial_reports.corpus import parse_markdown_table, read_jsonl
from examples.financial_reports.grader_server import create_grader_app
from examples.financial_reports.server import TOOL_SCHEMAS, create_app
from examples.financial_reports.synthetic import generate, write_synthetic
from examples.financial_reports.tatqa import write_tatqa
from tests.conftest import serve_app
from workers.engine.tools_client import ToolClient

TATQA_DEV = Path(__file__).resolve().parents[2].parent / "shared/data/tatqa/tatqa_dataset_dev.json"


# --- synthetic corpus -----------------------------------------------------------------------------


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(derivation: str) -> float:
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant)
        return float(node.value)

    return walk(ast.parse(derivation.replace(",", ""), mode="eval").body)


def _expected(question: str, table: dict[tuple[str, str], float], labels: list[str]) -> float:
    """The answer worked out from the question's wording and the parsed table alone."""
    years = re.findall(r"\b(?:19|20)\d\d\b", question)
    label = next(l for l in sorted(labels, key=len, reverse=True) if l.lower() in question.lower()
                 or (l.startswith("Employees") and "employees" in question))
    if question.startswith("What was the percentage change"):
        before, now = table[label, years[0]], table[label, years[1]]
        return round((now - before) / before * 100, 2)
    if question.startswith("By how much"):
        return round(table[label, years[1]] - table[label, years[0]], 1)
    if "as a percentage of revenue" in question:
        return round(table[label, years[0]] / table["Revenue", years[0]] * 100, 2)
    if "how much larger" in question:
        other = next(l for l in labels if l != "Revenue" and f"its {l.lower()}" in question)
        return round(table["Revenue", years[0]] - table[other, years[0]], 1)
    return table[label, years[0]]


def test_synthetic_answers_recomputed_from_the_rendered_tables() -> None:
    documents, rows = generate(seed=7, n_companies=30, years=[2020, 2021, 2022, 2023])
    pages = {d.path: d.render() for d in documents}
    assert len(rows) >= 300
    for row in rows:
        cells = parse_markdown_table(pages[row["document"]])
        header, body = cells[0], cells[1:]
        table = {(r[0], header[i]): _number(r[i]) for r in body for i in (1, 2)}
        question = row["messages"][0]["content"]
        assert row["company"] in question and row["company"] in pages[row["document"]]
        assert float(row["answer"]) == pytest.approx(_expected(question, table, [r[0] for r in body]), abs=1e-9)
        if row["derivation"]:
            assert round(_evaluate(row["derivation"]), 2) == pytest.approx(float(row["answer"]), abs=0.006)
        assert row["scale"] in {"", "thousand", "million", "percent"} and row["source"] == "synthetic"
        assert set(row) == {"messages", "answer", "scale", "unit", "company", "year", "document", "derivation",
                            "answer_type", "source"}


def test_synthetic_is_deterministic_per_seed(tmp_path: Path) -> None:
    assert generate(3, 5) == generate(3, 5)
    assert generate(3, 5)[1] != generate(4, 5)[1]
    root = write_synthetic(tmp_path, seed=1, n_companies=2, years=[2022, 2023])
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.md")) == sorted(
        d.path for d in generate(1, 2, [2022, 2023])[0])
    assert read_jsonl(tmp_path / "questions.jsonl") == generate(1, 2, [2022, 2023])[1]


def test_demo_task_answers_are_the_report_tables_figures_and_held_out_companies_are_unseen(tmp_path: Path) -> None:
    from examples.financial_reports import demo_task

    corpus, train, held_out = demo_task.build(tmp_path, seed=5, companies=7, years=[2022, 2023],
                                              held_out_companies=2, system_prompt="SYS")
    documents = {p.relative_to(corpus).as_posix(): p.read_text() for p in corpus.rglob("*.md")}
    assert len(train) + len(held_out) == 7 * 2 * 2  # every report: its revenue and its net income
    for row in train + held_out:
        assert row["messages"][0] == {"role": "system", "content": "SYS"}
        question = row["messages"][1]["content"]
        assert question == f"What was {row['company']}'s {'revenue' if 'revenue' in question else 'net income'} " \
                           f"in {row['year']}?"
        # Recomputed from the report's own table: the line item's figure in the report year's column,
        # in the table's unit (the heading says which).
        page = documents[row["document"]]
        cells = parse_markdown_table(page)
        column = cells[0].index(row["year"])
        label = "Revenue" if "revenue" in question else "Net income"
        figure = next(_number(r[column]) for r in cells[1:] if r[0] == label)
        assert float(row["answer"]) == pytest.approx(figure)
        assert f"(in {row['scale']}s of USD" in page
    assert not {r["company"] for r in train} & {r["company"] for r in held_out}
    assert len({r["company"] for r in held_out}) == 2
    with pytest.raises(ValueError, match="held_out_companies"):
        demo_task.split_by_company(train, 0)


# --- TAT-QA -------------------------------------------------------------------------------------


def test_tatqa_loader_writes_numeric_rows_and_documents(tmp_path: Path) -> None:
    if not TATQA_DEV.is_file():
        pytest.skip(f"TAT-QA dev split not found at {TATQA_DEV}; see examples/financial_reports/README.md")
    root, result = write_tatqa(TATQA_DEV, tmp_path)
    rows = read_jsonl(tmp_path / "questions.jsonl")
    assert len(rows) == len(result.rows) > 900 and result.skipped["multi-span"] > 0
    assert {r["answer_type"] for r in rows} == {"arithmetic", "span"}
    for row in rows:
        float(row["answer"])  # a plain number
        assert (root / row["document"]).is_file()
        assert re.fullmatch(r"report-[0-9a-f]{8}/(\d{4}|na)/report\.md", row["document"])
        assert row["source"] == "tatqa" and "tools" not in row
    first = (root / "report-3ffd9053/2019/report.md").read_text()
    assert "| Total sales | $1,496.5 |" in first and "CC BY 4.0" in first
    assert {"answer": "1496.5", "scale": "million"}.items() <= rows[0].items()
    assert not list(tmp_path.rglob("*.json"))  # the source file is read, never copied


# --- tool server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("fin"), seed=0, n_companies=4, years=[2022, 2023])


@pytest.fixture(scope="module")
def tool_url(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    app = create_app(corpus, index_cache_dir=tmp_path_factory.mktemp("index"))
    with serve_app(app) as port:
        yield f"http://127.0.0.1:{port}"


def _call(url: str, name: str, arguments: dict | str, trace_id: str = "trace_t") -> tuple[str, str]:
    async def go() -> tuple[str, str]:
        tools = [{"name": n, "server_url": f"{url}/tools"} for n in ("search", "list", "cat", "rm")]
        async with ToolClient(tools, allowlist=["127.0.0.1"]) as client:
            args = arguments if isinstance(arguments, str) else json.dumps(arguments)
            result = await client.call(trace_id=trace_id, call_id=f"call_{name}_{hash(args)}", name=name,
                                       arguments_json=args, item={"answer": "1"})
            return result.status, result.output

    return asyncio.run(go())


def test_search_finds_the_named_companys_report(tool_url: str, corpus: Path) -> None:
    for company_dir in sorted(p.name for p in corpus.iterdir()):
        name = " ".join(company_dir.split("-")).title()
        status, output = _call(tool_url, "search", {"query": f"{name} revenue 2023", "k": 3})
        assert status == "ok"
        assert output.splitlines()[0].startswith(f"{company_dir}/"), output
        assert len(output.splitlines()) == 3 and " — " in output


def test_search_can_end_with_the_call_that_reads_its_top_hit(tool_url: str, corpus: Path, tmp_path: Path) -> None:
    """benchmarks/demo_learning --search-suggests-cat: the call is written out for a model to copy,
    and the engine's parser reads it as the cat of the top hit's report."""
    from workers.engine.toolcalls import HermesParser, as_tool_schemas

    with serve_app(create_app(corpus, index_cache_dir=tmp_path, suggest_cat=True)) as port:
        url = f"http://127.0.0.1:{port}"
        status, output = _call(url, "search", {"query": "revenue 2023", "k": 2})
        top = output.splitlines()[0].split(" — ")[0]
        turn = HermesParser().parse(output, as_tool_schemas(TOOL_SCHEMAS))
        assert status == "ok" and [call.name for call in turn.calls] == ["cat"] and not turn.issues
        status, report = _call(url, "cat", turn.calls[0].arguments)
        assert status == "ok" and report == (corpus / top).read_text()
    assert "<tool_call>" not in _call(tool_url, "search", {"query": "revenue 2023", "k": 2})[1]  # by default


def test_list_and_cat_with_paging(tool_url: str, corpus: Path) -> None:
    status, top = _call(tool_url, "list", {})
    assert status == "ok" and sorted(top.splitlines()[1:]) == sorted(f"{p.name}/" for p in corpus.iterdir())
    company = top.splitlines()[1].rstrip("/")
    assert _call(tool_url, "list", {"path": f"{company}/2023"})[1].splitlines()[1:] == ["annual-report.md"]
    path = f"{company}/2023/annual-report.md"
    full = (corpus / path).read_text()
    status, whole = _call(tool_url, "cat", {"path": path})
    assert status == "ok" and whole == full and "| Revenue |" in whole
    first = _call(tool_url, "cat", {"path": path, "limit": 100})[1]
    assert first.startswith(full[:100]) and f"{len(full) - 100} remain" in first and "offset=100" in first
    rest = _call(tool_url, "cat", {"path": path, "offset": 100, "limit": 100_00})[1]
    assert rest.startswith(full[100:]) and "end of document" in rest


@pytest.mark.parametrize(("name", "arguments", "message"), [
    ("cat", {"path": "../../etc/passwd"}, "outside the corpus"),
    ("cat", {"path": "/etc/passwd"}, "relative to the corpus root"),
    ("list", {"path": "../.."}, "outside the corpus"),
    ("cat", {"path": "nobody/2023/annual-report.md"}, "no such file"),
    ("cat", {"path": 12}, "path"),
    ("search", {"query": "revenue", "k": "many"}, "k"),
    ("search", {"query": "revenue", "k": 50}, "k"),
    ("search", "{not json", "not valid JSON"),
    ("search", "[1, 2]", "JSON object"),
    ("cat", {"path": "x", "colour": "red"}, "colour"),
    ("rm", {"path": "x"}, "unknown tool 'rm'"),
])
def test_model_mistakes_get_a_4xx_the_model_can_read(tool_url: str, name: str, arguments: dict | str,
                                                      message: str) -> None:
    status, output = _call(tool_url, name, arguments)
    assert status == "client_error"
    assert message in output and "root:" not in output


def test_traces_are_kept_per_rollout(tool_url: str) -> None:
    _call(tool_url, "list", {}, trace_id="trace_a")
    _call(tool_url, "search", {"query": "net income"}, trace_id="trace_a")
    _call(tool_url, "cat", {"path": "../secret"}, trace_id="trace_b")
    a = httpx.get(f"{tool_url}/traces/trace_a").json()
    b = httpx.get(f"{tool_url}/traces/trace_b").json()
    assert [c["tool"] for c in a["calls"]] == ["list", "search"] and a["count"] == 2
    assert [(c["tool"], c["status"]) for c in b["calls"]] == [("cat", 400)]
    assert all(c["output_chars"] > 0 and c["at"] > 0 for c in a["calls"] + b["calls"])
    assert httpx.get(f"{tool_url}/traces/trace_never").status_code == 404
    assert httpx.get(f"{tool_url}/healthz").json()["status"] == "ok"


def test_index_is_cached_across_starts(corpus: Path, tmp_path: Path) -> None:
    first = create_app(corpus, index_cache_dir=tmp_path)
    second = create_app(corpus, index_cache_dir=tmp_path)
    assert not first.state.index.from_cache and second.state.index.from_cache
    assert (first.state.index.embeddings == second.state.index.embeddings).all()
    assert len(list(tmp_path.glob("*.npy"))) == 1


def test_tool_schemas_match_the_tools() -> None:
    assert [t["function"]["name"] for t in TOOL_SCHEMAS] == ["search", "list", "cat"]
    assert TOOL_SCHEMAS[0]["function"]["parameters"]["properties"]["k"]["maximum"] == 10


# --- endpoint grader ------------------------------------------------------------------------------


def test_grader_scores_the_answer_and_the_number_of_calls(tool_url: str) -> None:
    for n in range(2):
        _call(tool_url, "search", {"query": f"revenue {n}"}, trace_id="trace_two")
    for n in range(6):
        _call(tool_url, "search", {"query": f"net income {n}"}, trace_id="trace_six")
    with serve_app(create_grader_app(tool_url)) as port:
        def grade(text: str, trace_id: str, answer: str = "1234.5", scale: str = "million") -> dict:
            body = {"sample": {"output_text": text}, "item": {"answer": answer, "scale": scale},
                    "trace_id": trace_id}
            return httpx.post(f"http://127.0.0.1:{port}/grade", json=body).json()

        assert grade("Revenue was $1,234.5 million.", "trace_none") == {
            "score": 1.0, "details": {"correct": True, "tool_calls": 0, "tokens": 0, "efficiency": 1.0}}
        assert grade("1,234.5", "trace_two")["score"] == 1.0  # two calls are free
        six = grade("about 1.2345 billion", "trace_six")
        assert six["score"] == pytest.approx(0.8) and six["details"]["tool_calls"] == 6
        assert grade("999", "trace_two")["score"] == 0.0
        assert grade("12.5%", "trace_none", answer="12.5", scale="percent")["score"] == 1.0
        bad = httpx.post(f"http://127.0.0.1:{port}/grade", json={"sample": {}, "item": {}, "trace_id": "t"})
        assert bad.status_code == 400


def test_grader_efficiency_is_floored_at_half() -> None:
    from examples.financial_reports.grader_server import Charges

    assert [Charges().efficiency(n) for n in (0, 2, 3, 12, 100)] == [1.0, 1.0, 0.95, 0.5, 0.5]


def test_the_demo_grader_charges_every_call_after_the_first_and_every_token(tool_url: str) -> None:
    from examples.financial_reports.grader_server import Charges

    for path in ("", "acme-systems", "acme-systems/2023", "acme-systems/2022"):
        _call(tool_url, "list", {"path": path}, trace_id="trace_four")
    _call(tool_url, "search", {"query": "revenue"}, trace_id="trace_one")
    charges = Charges(free_calls=1, call_penalty=0.1, token_penalty=0.25, floor=0.2)
    with serve_app(create_grader_app(tool_url, charges=charges)) as port:
        def grade(trace_id: str, completion: int, tool_output: int) -> dict:
            body = {"sample": {"output_text": "$1,234.5 million",
                               "usage": {"completion_tokens": completion, "tool_output_tokens": tool_output}},
                    "item": {"answer": "1234.5", "scale": "million"}, "trace_id": trace_id}
            return httpx.post(f"http://127.0.0.1:{port}/grade", json=body).json()

        short, long = grade("trace_one", 60, 140), grade("trace_four", 160, 440)
        assert short["score"] == pytest.approx(1 - 0.25 * 0.2) and short["details"]["tokens"] == 200
        assert long["score"] == pytest.approx(1 - 0.1 * 3 - 0.25 * 0.6)  # 3 charged calls, 600 tokens
        assert grade("trace_four", 4000, 8000)["score"] == pytest.approx(0.2)  # a right answer keeps the floor
