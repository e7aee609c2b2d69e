"""The demo's task: questions one `search` can answer, split so that held-out questions are about
companies never trained on. Used by `agent-rft demo` (demo.py beside it) and benchmarks/demo_learning.

A synthetic report's opening paragraph quotes its year's revenue and net income ("In 2023, Acme
Robotics reported revenue of $1,234.5 million, up 4.0% from 2022. Net income was $98.7 million."),
and the search tool returns that paragraph as the snippet of the report. So the questions "What was
Acme Robotics's revenue in 2023?" and "... net income ..." need one search and reading the right
number off its result: a task SmolLM2-135M-Instruct sometimes solves and can learn
(benchmarks/demo_learning/README.md). The answer is read back from the rendered report text, so a
question is only made when the report really states its answer in words.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.financial_reports.corpus import make_row, write_corpus
from examples.financial_reports.synthetic import generate

# What an opening paragraph says, per line item the demo asks about.
QUOTED = {"revenue": r"reported revenue of \$([\d,\.]+) (thousand|million)",
          "net income": r"Net income was \$([\d,\.]+) (thousand|million)"}


def quoted_rows(documents: Sequence[Any], items: Sequence[str] = tuple(QUOTED)) -> list[dict[str, Any]]:
    """One question per report and line item that the report's text quotes, in document order."""
    rows = []
    for document in documents:
        company, year = document.title.split(" — Annual report ")
        text = document.render()
        for item in items:
            match = re.search(QUOTED[item], text)
            if match is None:
                raise ValueError(f"{document.path} does not quote its {item}")
            rows.append(make_row(
                question=f"What was {company}'s {item} in {year}?", answer=match[1].replace(",", ""),
                scale=match[2], unit="USD", company=company, year=year, document=document.path,
                derivation=f"quoted: {match[0]}", answer_type="span", source="synthetic"))
    return rows


def split_by_company(rows: Sequence[dict[str, Any]], held_out_companies: int
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): the last `held_out_companies` companies (in generation order, itself
    seeded) are never trained on, so held-out accuracy measures what transfers."""
    names = list(dict.fromkeys(row["company"] for row in rows))
    if not 0 < held_out_companies < len(names):
        raise ValueError(f"held_out_companies must be between 1 and {len(names) - 1}, got {held_out_companies}")
    test = set(names[len(names) - held_out_companies:])
    return [r for r in rows if r["company"] not in test], [r for r in rows if r["company"] in test]


def with_system_prompt(rows: Sequence[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    return [{**row, "messages": [{"role": "system", "content": prompt}, *row["messages"]]} for row in rows]


def build(out_dir: Path, *, seed: int, companies: int, years: Sequence[int], held_out_companies: int,
          system_prompt: str, items: Sequence[str] = tuple(QUOTED)
          ) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """Write the corpus (and all its generated questions, for reference) under `out_dir`;
    return (corpus root, training rows, held-out rows), each row with the system prompt."""
    documents, generated = generate(seed, companies, years)
    corpus = write_corpus(out_dir, documents, generated)
    train, held_out = split_by_company(quoted_rows(documents, items), held_out_companies)
    return corpus, with_system_prompt(train, system_prompt), with_system_prompt(held_out, system_prompt)
