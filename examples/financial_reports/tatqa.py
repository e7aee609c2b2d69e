"""Load TAT-QA (Zhu et al., ACL 2021; CC BY 4.0) into the corpus layout of corpus.py.

TAT-QA is not shipped with this project: download `dataset_raw/tatqa_dataset_dev.json` (or the
train split) from the TAT-QA repository on GitHub (NExTplusplus/TAT-QA) and pass its path.

Each TAT-QA record (one table and its paragraphs from a real report) becomes one document. TAT-QA
does not name the company or the year, so the path is made from what it does have:

    report-<first 8 hex digits of the table uid>/<latest year in the table's header, or "na">/report.md

Only questions with a numeric answer become rows: `arithmetic` ones, and `span` ones whose single
span is a number ("$1,496.5", "(12)", "7.5%"). Multi-span, count and text answers are skipped and
counted. The answer is stored as a plain number in text with TAT-QA's scale; the unit is "USD"
when the document shows a dollar sign, else "".

    python -m examples.financial_reports.tatqa --input tatqa_dataset_dev.json --out data/tatqa
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_rft.graders.implementations.numeric_match import find_amounts
from examples.financial_reports.corpus import Document, make_row, write_corpus

ATTRIBUTION = ("Source: TAT-QA (Zhu et al., ACL 2021), NExTplusplus/TAT-QA on GitHub, "
               "licensed CC BY 4.0.")
_YEAR = re.compile(r"\b(19[5-9]\d|20\d\d)\b")
# A span that is one number and nothing else: currency, sign, parentheses, thousands separators, %.
_NUMERIC_SPAN = re.compile(r"^\s*[-\u2212]?\s*\(?\s*[-\u2212]?\s*\$?\s*[-\u2212]?\d[\d,]*(\.\d+)?\s*%?\s*\)?\s*$")


@dataclass
class LoadResult:
    documents: list[Document]
    rows: list[dict[str, Any]]
    skipped: Counter[str] = field(default_factory=Counter)  # answer_type -> questions skipped


def load_tatqa(path: Path) -> LoadResult:
    """Documents and numeric-answer rows of a tatqa_dataset_*.json file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"TAT-QA file not found: {path} (see examples/financial_reports/README.md)")
    records = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(records, list):
        raise TypeError(f"{path}: expected a JSON list of TAT-QA records")
    result = LoadResult([], [])
    for record in records:
        document = record_document(record)
        result.documents.append(document)
        for question in record.get("questions", []):
            row = question_row(question, document)
            if row is None:
                result.skipped[question.get("answer_type", "unknown")] += 1
            else:
                result.rows.append(row)
    return result


def write_tatqa(input_path: Path, out_dir: Path) -> tuple[Path, LoadResult]:
    """Write the corpus and `questions.jsonl` under `out_dir`; returns (corpus root, what was loaded)."""
    result = load_tatqa(input_path)
    return write_corpus(Path(out_dir), result.documents, result.rows), result


def record_document(record: dict[str, Any]) -> Document:
    table = record["table"]["table"]
    company = f"report-{record['table']['uid'].replace('-', '')[:8]}"
    year = _latest_year(table)
    paragraphs = [p["text"] for p in sorted(record.get("paragraphs", []), key=lambda p: p.get("order", 0))]
    return Document(
        path=f"{company}/{year}/report.md",
        title=f"Report excerpt {company} ({year if year != 'na' else 'year not stated'})",
        paragraphs=paragraphs,
        table=[[str(cell) for cell in row] for row in table] if table else [],
        notes=[ATTRIBUTION],
    )


def _latest_year(table: list[list[Any]]) -> str:
    header = " ".join(str(cell) for row in table[:3] for cell in row)
    years = _YEAR.findall(header)
    return max(years) if years else "na"


def question_row(question: dict[str, Any], document: Document) -> dict[str, Any] | None:
    """The row of a numeric-answer question, None for the others."""
    value = numeric_answer(question.get("answer"), question.get("answer_type", ""))
    if value is None:
        return None
    company, year = document.path.split("/")[:2]
    rendered = document.render()
    return make_row(
        question=question["question"], answer=value, scale=question.get("scale") or "",
        unit="USD" if "$" in rendered else "", company=company, year=year, document=document.path,
        derivation=question.get("derivation") or "", answer_type=question.get("answer_type", ""), source="tatqa",
    )


def numeric_answer(answer: Any, answer_type: str) -> float | None:
    if answer_type == "arithmetic" and isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    single_span = answer_type == "span" and isinstance(answer, list) and len(answer) == 1
    if single_span and isinstance(answer[0], str) and _NUMERIC_SPAN.match(answer[0]):
        amounts = find_amounts(answer[0])
        if len(amounts) == 1:
            return amounts[0].mantissa  # the scale stays apart, in the row's "scale"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Turn a TAT-QA JSON file into the financial-reports corpus layout.")
    parser.add_argument("--input", type=Path, required=True, help="path to tatqa_dataset_*.json")
    parser.add_argument("--out", type=Path, required=True, help="output directory (corpus/ and questions.jsonl)")
    args = parser.parse_args(argv)
    root, result = write_tatqa(args.input, args.out)
    skipped = ", ".join(f"{k}: {v}" for k, v in sorted(result.skipped.items())) or "none"
    print(f"corpus: {root} ({len(result.documents)} documents)\n"
          f"questions: {args.out / 'questions.jsonl'} ({len(result.rows)} rows; skipped {skipped})\n{ATTRIBUTION}")


if __name__ == "__main__":
    main()
