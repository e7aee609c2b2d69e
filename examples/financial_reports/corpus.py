"""The on-disk layout shared by the synthetic corpus and the TAT-QA loader.

    <out_dir>/corpus/<company>/<year>/<document>.md   one readable markdown page per report
    <out_dir>/questions.jsonl                          one training row per question

The questions live beside the corpus, not inside it: the tool server serves `<out_dir>/corpus`
only, so the agent can never `cat` the answers.

A row is `{"messages": [{"role": "user", "content": question}], "answer", "scale", "unit",
"company", "year", "document", "derivation", "answer_type", "source"}`: the question alone (the
agent has to search for the report), the answer as a plain number in text with its scale
("", thousand, million, billion, percent) apart, as TAT-QA stores it and as the `numeric_match`
grader's `scale` option reads it. Rows carry no `tools`: the job declares them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

CORPUS_DIR = "corpus"
QUESTIONS_FILE = "questions.jsonl"
SCALES = ("", "thousand", "million", "billion", "percent")


class CorpusPathError(ValueError):
    """A path the corpus cannot serve: outside the corpus root, absolute, or missing."""


@dataclass(frozen=True)
class Document:
    """One report page: where it goes in the tree and what it says."""

    path: str  # relative to the corpus root: "<company>/<year>/<document>.md"
    title: str
    paragraphs: Sequence[str]
    table: Sequence[Sequence[str]]  # header row first
    table_caption: str = ""
    notes: Sequence[str] = field(default_factory=tuple)  # paragraphs after the table

    def render(self) -> str:
        return render_markdown(self.title, self.paragraphs, self.table, self.table_caption, self.notes)


def render_markdown(
    title: str, paragraphs: Iterable[str], table: Sequence[Sequence[str]], caption: str = "",
    notes: Iterable[str] = (),
) -> str:
    parts = [f"# {title}", *paragraphs]
    if caption:
        parts.append(caption)
    if table:
        parts.append(markdown_table(table))
    parts.extend(notes)
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    width = max(len(row) for row in rows)
    cells = [[_cell(c) for c in row] + [""] * (width - len(row)) for row in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * width]
    lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    # A pipe or a newline inside a cell would break the table's columns.
    return " ".join(str(value).replace("|", "/").split())


def parse_markdown_table(text: str) -> list[list[str]]:
    """The first markdown table of a page, as rows of cells (header first, separator dropped)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-:") and c for c in cells):
                rows.append(cells)
        elif rows:
            break
    return rows


def number_text(value: float) -> str:
    """A number as plain text without exponent or float noise: 1496.5, -12, 0.07."""
    text = format(Decimal(repr(float(value))).normalize(), "f")
    return "0" if text in ("-0", "0") else text


def make_row(
    *, question: str, answer: float | str, scale: str, unit: str, company: str, year: str | int,
    document: str, derivation: str, answer_type: str, source: str,
) -> dict[str, Any]:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return {
        "messages": [{"role": "user", "content": question}],
        "answer": answer if isinstance(answer, str) else number_text(answer),
        "scale": scale, "unit": unit, "company": company, "year": str(year), "document": document,
        "derivation": derivation, "answer_type": answer_type, "source": source,
    }


def write_corpus(out_dir: Path, documents: Iterable[Document], rows: Iterable[dict[str, Any]]) -> Path:
    """Write the documents under `out_dir/corpus` and the rows to `out_dir/questions.jsonl`;
    returns the corpus root (what the tool server serves)."""
    root = Path(out_dir) / CORPUS_DIR
    for document in documents:
        target = resolve_inside(root, document.path, must_exist=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(document.render(), encoding="utf-8")
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(Path(out_dir) / QUESTIONS_FILE, rows)
    return root


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def split_rows(
    rows: Sequence[dict[str, Any]], valid_fraction: float = 0.2, seed: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, valid), split by document so that no report is seen in both (deterministic)."""
    documents = sorted({row["document"] for row in rows})
    random.Random(seed).shuffle(documents)
    held_out = set(documents[: round(len(documents) * valid_fraction)])
    train = [row for row in rows if row["document"] not in held_out]
    valid = [row for row in rows if row["document"] in held_out]
    return train, valid


def write_split(out_dir: Path, valid_fraction: float = 0.2, seed: int = 0) -> tuple[Path, Path]:
    """Split `out_dir/questions.jsonl` into `train.jsonl` and `valid.jsonl` beside it."""
    train, valid = split_rows(read_jsonl(Path(out_dir) / QUESTIONS_FILE), valid_fraction, seed)
    paths = Path(out_dir) / "train.jsonl", Path(out_dir) / "valid.jsonl"
    write_jsonl(paths[0], train)
    write_jsonl(paths[1], valid)
    return paths


def resolve_inside(root: Path, relative: str, *, must_exist: bool = True) -> Path:
    """`root/relative`, refusing anything that lands outside `root` (`..`, absolute paths,
    symlinks pointing out), so a tool call can never read another file of the machine."""
    if "\x00" in relative:
        raise CorpusPathError("path must not contain NUL characters")
    if Path(relative).is_absolute() or relative.startswith(("/", "\\")):
        raise CorpusPathError(f"path must be relative to the corpus root, got {relative!r}")
    base = Path(root).resolve()
    target = (base / relative).resolve()
    if target != base and not target.is_relative_to(base):
        raise CorpusPathError(f"path {relative!r} is outside the corpus")
    if must_exist and not target.exists():
        raise CorpusPathError(f"no such file or directory: {relative!r}")
    return target


def iter_documents(root: Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every markdown document under `root`, in a stable order."""
    base = Path(root).resolve()
    for path in sorted(base.rglob("*.md")):
        if path.is_file() and path.resolve().is_relative_to(base):
            yield path.relative_to(base).as_posix(), path.read_text(encoding="utf-8")


def read_document(root: Path, relative: str) -> str:
    path = resolve_inside(root, relative)
    if not path.is_file():
        raise CorpusPathError(f"not a file: {relative!r} (use list to see a directory)")
    return path.read_text(encoding="utf-8", errors="replace")
