"""`numeric_match` (this service's extension): the number in the answer equals the reference number
within a tolerance. Reward 1.0 or 0.0.

Numbers are read as finance writes them: `$1,234.5`, `(12)` = -12, `-€3.5bn`, `1.2 million`, `2.4k`,
`7%`, `25 bps`, `USD 5m`, inside a sentence. Hand-written: of the parsing libraries on PyPI,
price-parser reads currency amounts but not scale words, percentages or accounting negatives, and
quantulum3 reads units of measurement but not `(12)`, `bn`/`mn` or `bps`; none handles all of these.

Rules (see docs/graders.md):
- A percent sign on one side only is ambiguous (`7%` against a ratio 0.07, or `0.07` against a
  reference of 7 percent): both readings are tried.
- An answer without a scale word also matches the reference's unscaled number (`1.2` for a reference
  of 1.2 million), since answers often keep the unit of the table they were read from.
- An unreadable answer is a wrong answer (reward 0, no error flag); an unreadable reference is a
  grader configuration problem (`other_error`).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any

from agent_rft.graders.core import GradeResult, GraderContext, GraderError, Sample, implements
from agent_rft.graders.templating import render

SCALES = {
    "thousand": 1e3, "thousands": 1e3, "k": 1e3,
    "million": 1e6, "millions": 1e6, "mn": 1e6, "mm": 1e6, "m": 1e6,
    "billion": 1e9, "billions": 1e9, "bn": 1e9, "b": 1e9,
    "trillion": 1e12, "trillions": 1e12, "tn": 1e12, "t": 1e12,
}
_PERCENT_WORDS = {
    "%": 1.0, "percent": 1.0, "per cent": 1.0, "pct": 1.0,
    "bps": 0.01, "bp": 0.01, "basis points": 0.01, "basis point": 0.01,  # 1 bp = 0.01 percent
}
_CURRENCY = r"(?:US\$|[$€£¥₹]|(?:USD|EUR|GBP|JPY|CHF|CNY|INR|CAD|AUD)(?![A-Za-z]))"
_GAP = r"[^\S\n]*"  # spaces between a number and its unit, not across lines


def _alternatives(words: Any) -> str:
    # Longest first, so that "million" is not read as "m" followed by "illion".
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_NUMBER = re.compile(
    r"(?<![\w.])"  # not the tail of a word or of a dotted number ("FY2023", "1.2.3")
    r"(?P<open>\(\s*)?"
    r"(?P<sign1>[-+\u2212])?"
    rf"(?:{_CURRENCY}{_GAP})?"
    r"(?P<sign2>[-+\u2212])?"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?P<exp>[eE][-+]?\d+)?"
    rf"(?:{_GAP}(?P<scale>{_alternatives(SCALES)})(?!\w))?"
    rf"(?:{_GAP}(?P<percent>%|(?:{_alternatives(set(_PERCENT_WORDS) - {'%'})})(?!\w)))?"
    rf"(?:{_GAP}{_CURRENCY})?"
    r"(?P<close>\s*\))?",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Amount:
    mantissa: float  # the number as written, sign included, before its scale word
    multiplier: float  # from the scale word: 1, 1e3, 1e6, ...
    percent: bool  # written with %, percent or bps (bps already converted to percent)

    @property
    def value(self) -> float:
        return self.mantissa * self.multiplier


def _amount(match: re.Match[str]) -> Amount:
    digits = match["digits"].replace(",", "") + (match["exp"] or "")
    mantissa = float(digits)
    # Accounting negatives: "(12)", also "(-12)" and "($12)"; a minus before or after the currency.
    in_parentheses = bool(match["open"] and match["close"])
    negative = in_parentheses or (match["sign1"] or match["sign2"] or "+") in "-\u2212"
    percent_word = (match["percent"] or "").lower()
    mantissa *= _PERCENT_WORDS.get(re.sub(r"\s+", " ", percent_word), 1.0)
    multiplier = SCALES[match["scale"].lower()] if match["scale"] else 1.0
    return Amount(-mantissa if negative else mantissa, multiplier, bool(percent_word))


def find_amounts(text: str) -> list[Amount]:
    return [_amount(m) for m in _NUMBER.finditer(text)]


_YEAR = re.compile(r"(?:19|20)\d\d")


def _is_year(match: re.Match[str]) -> bool:
    """A bare four-digit 1900-2099: no currency, sign, decimals, scale, percent or parentheses."""
    return bool(_YEAR.fullmatch(match[0].strip()))


def pick_amount(text: str, pick: str, *, ignore_years: bool = False) -> Amount | None:
    """The answer's number: the first, the last, or the only one; None when there is none to take.
    With `ignore_years`, bare years ("in 2023") are not candidates.

    Reads matches lazily and converts one: a multi-megabyte answer full of numbers stays cheap."""
    matches = (m for m in _NUMBER.finditer(text) if not (ignore_years and _is_year(m)))
    if pick == "first":
        match = next(matches, None)
    elif pick == "only":
        two = list(islice(matches, 2))
        match = two[0] if len(two) == 1 else None
    else:
        last = deque(matches, maxlen=1)
        match = last[0] if last else None
    return _amount(match) if match else None


def reference_amount(text: str, scale: str | None) -> Amount:
    amounts = [_amount(m) for m in islice(_NUMBER.finditer(text), 2)]
    if len(amounts) != 1:
        found = "no number" if not amounts else "several numbers"
        message = f"numeric_match reference must hold exactly one number, found {found} in {text[:200]!r}"
        raise GraderError("other_error", message)
    return _apply_scale(amounts[0], scale)


def _apply_scale(amount: Amount, scale: str | None) -> Amount:
    """Apply the item's separate unit (`scale` template), e.g. TAT-QA's "", thousand, million, percent."""
    word = (scale or "").strip().lower()
    if not word:
        return amount
    if word in _PERCENT_WORDS:
        unit = Amount(amount.mantissa * _PERCENT_WORDS[word], 1.0, True)
    elif word in SCALES:
        unit = Amount(amount.mantissa, SCALES[word], False)
    else:
        known = "'', thousand, million, billion, trillion, percent"
        raise GraderError("other_error", f"numeric_match scale {scale!r} is not one of {known}")
    if (amount.multiplier != 1.0 or amount.percent) and amount != unit:
        message = f"numeric_match reference already carries a unit; scale {scale!r} would apply a second one"
        raise GraderError("other_error", message)
    return unit


def _candidate_values(answer: Amount, reference: Amount) -> tuple[set[float], set[float]]:
    answers = {answer.value}
    if answer.percent != reference.percent:  # 7% vs 0.07, or 0.07 vs 7 percent: try both readings
        answers.add(answer.value / 100 if answer.percent else answer.value * 100)
    references = {reference.value}
    if answer.multiplier == 1.0:  # "1.2" answering "1.2 million": the unit of the table it read
        references.add(reference.mantissa)
    return answers, references


def amounts_match(answer: Amount, reference: Amount, rel_tol: float, abs_tol: float) -> bool:
    answers, references = _candidate_values(answer, reference)
    return any(math.isclose(a, r, rel_tol=rel_tol, abs_tol=abs_tol) for a in answers for r in references)


@implements("numeric_match")
async def grade_numeric_match(
    config: Any, sample: Sample, item: dict[str, Any], ctx: GraderContext, trace_id: str | None
) -> GradeResult:
    scale = render(config.scale, sample, item) if config.scale else None
    reference = reference_amount(render(config.reference, sample, item), scale)
    # Scanning a multi-megabyte answer takes seconds: keep it off the event loop.
    answer = await asyncio.to_thread(pick_amount, render(config.input, sample, item), config.pick,
                                   ignore_years=config.ignore_years)
    matched = answer is not None and amounts_match(answer, reference, config.rel_tol, config.abs_tol)
    reward = 1.0 if matched else 0.0
    threshold = 1.0 if config.pass_threshold is None else config.pass_threshold
    return GradeResult(name=config.name, type=config.type, reward=reward, passed=reward >= threshold)
