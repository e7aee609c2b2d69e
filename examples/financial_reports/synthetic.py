"""A synthetic corpus of annual reports of invented companies, with questions, deterministic for a seed.

Each company has a time series of line items; its report for year Y shows Y and Y-1 side by side
(as real annual reports do) in a table stated in thousands or millions of USD, and 2-3 paragraphs
that quote some of the figures. Every question needs one or two numbers of ONE report, sometimes
with a calculation (difference, percentage change, share of revenue); its row stores the answer,
scale, unit and the derivation, in TAT-QA's style ("1,234.5 - 1,100.2").

    python -m examples.financial_reports.synthetic --out data/fin --seed 0 --companies 12
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.financial_reports.corpus import Document, make_row, write_corpus

_PREFIXES = ["Norvale", "Quillon", "Brackwater", "Tessaro", "Halvorn", "Orvanta", "Pellucid", "Zendrik",
             "Marrowind", "Kestrava", "Lumiscope", "Aldergate", "Corvexa", "Fennimore", "Straton",
             "Vireo", "Glimmerlake", "Ostrava", "Pinecrest", "Rudalis", "Sablewood", "Tamsin",
             "Umberfield", "Wexley"]
_SUFFIXES = ["Systems", "Holdings", "Robotics", "Foods", "Logistics", "Biotech", "Energy", "Materials",
             "Networks", "Apparel", "Analytics", "Marine"]
_SECTORS = {"Systems": "enterprise software", "Holdings": "diversified industrial services",
            "Robotics": "industrial automation", "Foods": "packaged foods", "Logistics": "freight and warehousing",
            "Biotech": "diagnostic reagents", "Energy": "solar installation", "Materials": "specialty chemicals",
            "Networks": "telecommunications equipment", "Apparel": "outdoor clothing",
            "Analytics": "data services", "Marine": "shipbuilding and repair"}

MONEY_ITEMS = ["Revenue", "Cost of revenue", "Gross profit", "Research and development",
               "Selling, general and administrative", "Operating income", "Net income"]
EMPLOYEES = "Employees at year end"
EXPENSE_ITEMS = ["Cost of revenue", "Research and development", "Selling, general and administrative"]


@dataclass(frozen=True)
class Company:
    name: str
    slug: str
    sector: str
    scale: str  # "thousand" or "million": the unit of the money figures in its tables
    series: dict[int, dict[str, float]]  # year -> line item -> value (in `scale` units; employees as is)


def generate(seed: int = 0, n_companies: int = 8, years: Sequence[int] = (2021, 2022, 2023)
             ) -> tuple[list[Document], list[dict[str, Any]]]:
    """(documents, rows) for `n_companies` invented companies, one report per company and year."""
    if not 1 <= n_companies <= len(_PREFIXES) * len(_SUFFIXES):
        raise ValueError(f"n_companies must be between 1 and {len(_PREFIXES) * len(_SUFFIXES)}")
    rng = random.Random(seed)
    companies = [_company(rng, name, sorted(years)) for name in _company_names(rng, n_companies)]
    documents, rows = [], []
    for company in companies:
        for year in sorted(years):
            document = _report(rng, company, year)
            documents.append(document)
            rows.extend(_questions(rng, company, year, document.path))
    return documents, rows


def write_synthetic(out_dir: Path, seed: int = 0, n_companies: int = 8,
                    years: Sequence[int] = (2021, 2022, 2023)) -> Path:
    """Generate and write the corpus and `questions.jsonl` under `out_dir`; returns the corpus root."""
    documents, rows = generate(seed, n_companies, years)
    return write_corpus(Path(out_dir), documents, rows)


def _company_names(rng: random.Random, count: int) -> list[str]:
    names = [f"{p} {s}" for p in _PREFIXES for s in _SUFFIXES]
    rng.shuffle(names)
    chosen: list[str] = []
    used_prefixes: set[str] = set()
    for name in names:  # distinct first words first, so that a query naming a company is unambiguous
        if name.split()[0] not in used_prefixes:
            chosen.append(name)
            used_prefixes.add(name.split()[0])
    chosen += [n for n in names if n not in chosen]
    return chosen[:count]


def _company(rng: random.Random, name: str, years: list[int]) -> Company:
    scale = rng.choice(["thousand", "million"])
    revenue = rng.uniform(40, 4000) if scale == "million" else rng.uniform(5_000, 900_000)
    employees = rng.randint(80, 40_000)
    series = {}
    for year in [years[0] - 1, *years]:  # one more year: the first report's comparison column
        series[year] = _line_items(rng, revenue, employees, scale)
        revenue *= rng.uniform(0.85, 1.3)
        employees = max(10, round(employees * rng.uniform(0.9, 1.2)))
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return Company(name, slug, _SECTORS[name.split()[1]], scale, series)


def _line_items(rng: random.Random, revenue: float, employees: int, scale: str) -> dict[str, float]:
    digits = 1 if scale == "million" else 0  # millions with one decimal, thousands whole
    money = lambda x: round(x, digits) if digits else float(round(x))
    items = {"Revenue": money(revenue), "Cost of revenue": money(revenue * rng.uniform(0.4, 0.65)),
             "Research and development": money(revenue * rng.uniform(0.04, 0.14)),
             "Selling, general and administrative": money(revenue * rng.uniform(0.08, 0.15))}
    # Totals from the rounded items, so that the table adds up to the digit.
    items["Gross profit"] = round(items["Revenue"] - items["Cost of revenue"], digits)
    items["Operating income"] = round(items["Gross profit"] - items["Research and development"]
                                      - items["Selling, general and administrative"], digits)
    items["Net income"] = money(items["Operating income"] * rng.uniform(0.6, 0.85))
    items[EMPLOYEES] = float(employees)
    return items


def format_amount(value: float, scale: str) -> str:
    return f"{value:,.1f}" if scale == "million" else f"{value:,.0f}"


def _report(rng: random.Random, company: Company, year: int) -> Document:
    now, before = company.series[year], company.series[year - 1]
    unit = "millions" if company.scale == "million" else "thousands"
    table = [["Line item", str(year), str(year - 1)]]
    for item in MONEY_ITEMS:
        table.append([item, format_amount(now[item], company.scale), format_amount(before[item], company.scale)])
    table.append([EMPLOYEES, f"{now[EMPLOYEES]:,.0f}", f"{before[EMPLOYEES]:,.0f}"])
    growth = (now["Revenue"] - before["Revenue"]) / before["Revenue"] * 100
    paragraphs = [
        (f"{company.name} designs and sells {company.sector} products. This annual report covers the fiscal "
         f"year ended December 31, {year}."),
        (f"In {year}, {company.name} reported revenue of ${format_amount(now['Revenue'], company.scale)} "
         f"{company.scale}, {'up' if growth >= 0 else 'down'} {abs(growth):.1f}% from {year - 1}. "
         f"Net income was ${format_amount(now['Net income'], company.scale)} {company.scale}."),
    ]
    if rng.random() < 0.6:
        paragraphs.append(f"The company employed {now[EMPLOYEES]:,.0f} people at year end and continued to "
                          f"invest in research and development.")
    return Document(
        path=f"{company.slug}/{year}/annual-report.md",
        title=f"{company.name} — Annual report {year}",
        paragraphs=paragraphs,
        table_caption=f"Consolidated results (in {unit} of USD, except employees):",
        table=table,
    )


def _questions(rng: random.Random, company: Company, year: int, path: str) -> list[dict[str, Any]]:
    kinds = [_lookup, _change, _percent_change, _share_of_revenue, _item_difference]
    return [kind(rng, company, year, path) for kind in rng.sample(kinds, k=3)]


def _row(company: Company, year: int, path: str, **fields: Any) -> dict[str, Any]:
    return make_row(company=company.name, year=year, document=path, source="synthetic", **fields)


def _money_or_people(company: Company, item: str) -> tuple[str, str]:
    return ("", "employees") if item == EMPLOYEES else (company.scale, "USD")


def _lookup(rng: random.Random, company: Company, year: int, path: str) -> dict[str, Any]:
    item = rng.choice([*MONEY_ITEMS, EMPLOYEES])
    column = rng.choice([year, year - 1])
    question = (f"How many employees did {company.name} have at the end of {column}?" if item == EMPLOYEES
                else f"What was {company.name}'s {item.lower()} in {column}?")
    scale, unit = _money_or_people(company, item)
    return _row(company, year, path, question=question, answer=company.series[column][item], scale=scale,
                unit=unit, derivation="", answer_type="span")


def _change(rng: random.Random, company: Company, year: int, path: str) -> dict[str, Any]:
    item = rng.choice([*MONEY_ITEMS, EMPLOYEES])
    now, before = company.series[year][item], company.series[year - 1][item]
    scale, unit = _money_or_people(company, item)
    label = "number of employees" if item == EMPLOYEES else item.lower()
    fmt = lambda v: f"{v:,.0f}" if item == EMPLOYEES else format_amount(v, company.scale)
    return _row(company, year, path,
                question=f"By how much did {company.name}'s {label} change from {year - 1} to {year}?",
                answer=round(now - before, 1), scale=scale, unit=unit,
                derivation=f"{fmt(now)} - {fmt(before)}", answer_type="arithmetic")


def _percent_change(rng: random.Random, company: Company, year: int, path: str) -> dict[str, Any]:
    item = rng.choice([*MONEY_ITEMS, EMPLOYEES])
    now, before = company.series[year][item], company.series[year - 1][item]
    label = "number of employees" if item == EMPLOYEES else item.lower()
    fmt = lambda v: f"{v:,.0f}" if item == EMPLOYEES else format_amount(v, company.scale)
    return _row(company, year, path,
                question=f"What was the percentage change in {company.name}'s {label} from {year - 1} to {year}?",
                answer=round((now - before) / before * 100, 2), scale="percent", unit="",
                derivation=f"({fmt(now)} - {fmt(before)}) / {fmt(before)} * 100", answer_type="arithmetic")


def _share_of_revenue(rng: random.Random, company: Company, year: int, path: str) -> dict[str, Any]:
    item = rng.choice([*EXPENSE_ITEMS, "Gross profit", "Operating income", "Net income"])
    value, revenue = company.series[year][item], company.series[year]["Revenue"]
    fmt = lambda v: format_amount(v, company.scale)
    return _row(company, year, path,
                question=f"What was {company.name}'s {item.lower()} as a percentage of revenue in {year}?",
                answer=round(value / revenue * 100, 2), scale="percent", unit="",
                derivation=f"{fmt(value)} / {fmt(revenue)} * 100", answer_type="arithmetic")


def _item_difference(rng: random.Random, company: Company, year: int, path: str) -> dict[str, Any]:
    first, second = "Revenue", rng.choice(EXPENSE_ITEMS)
    a, b = company.series[year][first], company.series[year][second]
    fmt = lambda v: format_amount(v, company.scale)
    return _row(company, year, path,
                question=f"In {year}, how much larger was {company.name}'s {first.lower()} than its "
                         f"{second.lower()}?",
                answer=round(a - b, 1), scale=company.scale, unit="USD",
                derivation=f"{fmt(a)} - {fmt(b)}", answer_type="arithmetic")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic financial-reports corpus and questions.")
    parser.add_argument("--out", type=Path, required=True, help="output directory (corpus/ and questions.jsonl)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--companies", type=int, default=8)
    parser.add_argument("--years", type=int, nargs="+", default=[2021, 2022, 2023])
    args = parser.parse_args(argv)
    root = write_synthetic(args.out, args.seed, args.companies, args.years)
    print(f"corpus: {root}\nquestions: {args.out / 'questions.jsonl'}")


if __name__ == "__main__":
    main()
