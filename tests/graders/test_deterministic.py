"""string_check, text_similarity and numeric_match, called the way the service calls them: a config
validated through the `Grader` union, then `agent_rft.graders.core.grade`.

Expected values are worked out independently of the code under test: by hand for small examples
(shown in the comments), or with another entry point of the same library (sacrebleu's corpus BLEU)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from agent_rft.graders.core import ERROR_FLAGS, GradeResult, GraderContext, Sample, grade
from agent_rft.graders.schemas import GRADER_TYPES, Grader

GRADERS = TypeAdapter(Grader)
SIMILARITY_METRICS = (
    "fuzzy_match", "bleu", "gleu", "meteor", "cosine",
    "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
)


def config(**fields: Any) -> Any:
    return GRADERS.validate_python({"name": "g", **fields})


def run(
    grader: dict[str, Any], sample: str | dict[str, Any] | Sample = "", item: dict[str, Any] | None = None
) -> GradeResult:
    sample = sample if isinstance(sample, Sample) else Sample.from_model_sample(sample)
    return asyncio.run(grade(config(**grader), sample, item or {}, GraderContext()))


def raised_flags(result: GradeResult) -> list[str]:
    return [flag for flag in ERROR_FLAGS if result.errors.get(flag)]


def string_check(operation: str, text: str, reference: str) -> GradeResult:
    return run({"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.ref}}",
                "operation": operation}, text, {"ref": reference})


def similarity(metric: str, text: str, reference: str, **extra: Any) -> GradeResult:
    return run({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.ref}}",
                "evaluation_metric": metric, **extra}, text, {"ref": reference})


def numeric(answer: str, reference: str, scale: str | None = None, **extra: Any) -> GradeResult:
    grader: dict[str, Any] = {"type": "numeric_match", "reference": "{{item.answer}}", **extra}
    item: dict[str, Any] = {"answer": reference}
    if scale is not None:
        grader["scale"] = "{{item.scale}}"
        item["scale"] = scale
    return run(grader, answer, item)


# ---------------------------------------------------------------- string_check


@pytest.mark.parametrize(
    ("operation", "text", "reference", "reward"),
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "Paris", "paris", 0.0),
        ("eq", "Paris ", "Paris", 0.0),
        ("ne", "Paris", "London", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("like", "The capital is Paris.", "Paris", 1.0),
        ("like", "The capital is PARIS.", "Paris", 0.0),
        ("ilike", "The capital is PARIS.", "paris", 1.0),
        ("ilike", "Die STRASSE", "straße", 1.0),
        ("ilike", "The capital is Lyon.", "paris", 0.0),
    ],
)
def test_string_check_operations(operation: str, text: str, reference: str, reward: float) -> None:
    result = string_check(operation, text, reference)
    assert result.reward == reward
    assert result.passed is (reward == 1.0)
    assert raised_flags(result) == []


def test_string_check_run_response_has_openai_shape() -> None:
    body = string_check("eq", "yes", "yes").to_run_response()
    assert body["reward"] == 1.0
    assert body["metadata"]["type"] == "string_check" and body["metadata"]["name"] == "g"
    assert set(ERROR_FLAGS) <= set(body["metadata"]["errors"]) and not any(
        body["metadata"]["errors"][flag] for flag in ERROR_FLAGS
    )


# ---------------------------------------------------------------- templating through the graders


def test_nested_item_path_and_quoted_key() -> None:
    item = {"meta": {"answers": [{"text": "wrong"}, {"text": "Paris"}]}, "odd key": "Paris"}
    for reference in ("{{ item.meta.answers[1].text }}", "{{item['odd key']}}", "{{item.meta.answers[-1].text}}"):
        result = run({"type": "string_check", "input": "{{sample.output_text}}", "reference": reference,
                      "operation": "eq"}, "Paris", item)
        assert result.reward == 1.0, reference


def test_output_json_fields_are_templated() -> None:
    sample = json.dumps({"answer": {"city": "Paris", "population_m": 2.1}})
    result = run({"type": "string_check", "input": "{{sample.output_json.answer.city}}", "reference": "Paris",
                  "operation": "eq"}, sample)
    assert result.reward == 1.0
    result = run({"type": "numeric_match", "input": "{{sample.output_json.answer.population_m}}",
                  "reference": "2.1 million"}, sample)
    assert result.reward == 1.0


def test_output_tools_function_name_is_templated() -> None:
    sample = {"output_text": "", "output_tools": [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    ]}
    result = run({"type": "string_check", "input": "{{sample.output_tools[0].function.name}}",
                  "reference": "{{item.tool}}", "operation": "eq"}, sample, {"tool": "get_weather"})
    assert result.reward == 1.0


def test_non_string_values_render_as_json() -> None:
    result = run({"type": "string_check", "input": "{{item.numbers}} {{item.n}} {{item.none}}",
                  "reference": "[1, 2] 42 ", "operation": "eq"}, "", {"numbers": [1, 2], "n": 42, "none": None})
    assert result.reward == 1.0


@pytest.mark.parametrize(
    "grader",
    [
        {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.missing}}", "operation": "eq"},
        {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.missing}}",
         "evaluation_metric": "fuzzy_match"},
        {"type": "numeric_match", "reference": "{{item.missing}}"},
    ],
)
def test_missing_variable_scores_zero_with_invalid_variable_error(grader: dict[str, Any]) -> None:
    result = run(grader, "42", {"answer": "42"})
    assert result.reward == 0.0
    assert raised_flags(result) == ["invalid_variable_error"]
    assert "item.missing" in result.errors["details"]


def test_missing_list_index_names_the_path() -> None:
    result = run({"type": "string_check", "input": "{{sample.output_tools[0].function.name}}", "reference": "x",
                  "operation": "eq"}, "no tools called")
    assert raised_flags(result) == ["invalid_variable_error"]
    assert "sample.output_tools[0]" in result.errors["details"]


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize(
    "grader",
    [
        {"type": "string_check", "input": "{{ answer }}", "reference": "x", "operation": "eq"},
        {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.a[}}", "operation": "eq"},
        {"type": "text_similarity", "input": "{{output_text}}", "reference": "x", "evaluation_metric": "bleu"},
        {"type": "numeric_match", "reference": "{{ reference }}"},
        {"type": "numeric_match", "reference": "{{item.answer}}", "scale": "{{ scale }}"},
    ],
)
def test_bad_template_is_refused_when_the_grader_is_created(grader: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="template variable"):
        config(**grader)


@pytest.mark.parametrize(
    "grader",
    [
        {"type": "string_check", "input": "x", "reference": "x", "operation": "startswith"},
        {"type": "text_similarity", "input": "x", "reference": "x", "evaluation_metric": "bertscore"},
        {"type": "numeric_match", "reference": "1", "rel_tol": -0.1},
        {"type": "numeric_match", "reference": "1", "abs_tol": -1},
        {"type": "numeric_match", "reference": "1", "pick": "middle"},
        {"type": "numeric_match", "reference": "1", "tolerance": 0.1},
    ],
)
def test_invalid_config_is_refused(grader: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        config(**grader)


def test_numeric_match_defaults() -> None:
    grader = config(type="numeric_match", reference="{{item.answer}}")
    assert "numeric_match" in GRADER_TYPES
    assert (grader.input, grader.rel_tol, grader.abs_tol, grader.pick, grader.scale) == (
        "{{sample.output_text}}", 0.01, 1e-9, "last", None,
    )


# ---------------------------------------------------------------- text_similarity


@pytest.mark.parametrize("metric", [m for m in SIMILARITY_METRICS if m != "meteor"])
def test_identical_texts_score_one(metric: str) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    result = similarity(metric, text, text)
    assert result.reward == pytest.approx(1.0, abs=1e-6)
    assert raised_flags(result) == []


@pytest.mark.parametrize("metric", [m for m in SIMILARITY_METRICS if m != "cosine"])
def test_disjoint_texts_score_zero(metric: str) -> None:
    assert similarity(metric, "abc def ghi", "xyzuvw").reward == 0.0  # not even a space in common


@pytest.mark.parametrize("metric", SIMILARITY_METRICS)
def test_empty_texts(metric: str) -> None:
    assert similarity(metric, "", "").reward == 1.0
    assert similarity(metric, "", "something").reward == 0.0
    assert similarity(metric, "something", "  ").reward == 0.0


HYP, REF = "the cat sat on the mat", "the cat sat on a mat"


@pytest.mark.parametrize(
    ("metric", "text", "reference", "expected"),
    [
        # Indel similarity: LCS("kitten", "sitting") = "ittn" (4); 1 - (6 + 7 - 2*4) / 13
        ("fuzzy_match", "kitten", "sitting", 1 - 5 / 13),
        # n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths, so no brevity penalty
        ("bleu", HYP, REF, (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25),
        # GLEU: matching 1..4-grams (5+3+2+1) over max(hyp n-grams, ref n-grams) = 18
        ("gleu", HYP, REF, 11 / 18),
        # unigrams: P = 2/3, R = 2/4, F = 2PR / (P + R)
        ("rouge_1", "the cat sat", "the cat ran away", 4 / 7),
        # bigrams: "the cat" shared; P = 1/2, R = 1/3
        ("rouge_2", "the cat sat", "the cat ran away", 0.4),
        ("rouge_3", HYP, REF, 2 / 4),
        ("rouge_4", HYP, REF, 1 / 3),
        ("rouge_5", HYP, REF, 0.0),
        # all three words shared (rouge_1 would be 1.0), longest common subsequence 2: P = R = 2/3
        ("rouge_l", "cat the sat", "the cat sat", 2 / 3),
        # rouge works on any script, not only [a-z0-9]: 1 of 2 words shared
        ("rouge_1", "кошка сидит", "кошка спит", 0.5),
        # METEOR, identical 6 words in one chunk: 1 - 0.5 * (1/6)^3
        ("meteor", HYP, HYP, 1 - 0.5 * (1 / 6) ** 3),
        # Porter stems "cats" to "cat": 3 matches, one chunk
        ("meteor", "the cats ran", "the cat ran", 1 - 0.5 * (1 / 3) ** 3),
    ],
)
def test_metric_values(metric: str, text: str, reference: str, expected: float) -> None:
    assert similarity(metric, text, reference).reward == pytest.approx(expected, abs=1e-4)


def test_bleu_matches_sacrebleu_corpus_bleu_on_one_pair() -> None:
    import sacrebleu

    text, reference = "The quick brown fox jumped over the lazy dog.", "The quick brown fox jumps over the lazy dog."
    expected = sacrebleu.corpus_bleu([text], [[reference]]).score / 100
    assert 0 < expected < 1
    assert similarity("bleu", text, reference).reward == pytest.approx(expected, abs=1e-9)


def test_meteor_without_wordnet_matches_no_synonyms() -> None:
    from agent_rft.graders.implementations.text_similarity import _NoSynonyms, _wordnet

    if not isinstance(_wordnet(), _NoSynonyms):
        pytest.skip("nltk's WordNet corpus is installed here: synonyms match")
    # "big"/"large" are WordNet synonyms but do not match without it: 2 of 3 words in 2 chunks,
    # Fmean = 2/3, penalty = 0.5 * (2/2)^3
    assert similarity("meteor", "the big dog", "the large dog").reward == pytest.approx(1 / 3, abs=1e-4)


def test_pass_threshold_decides_passed_and_keeps_the_metric_as_reward() -> None:
    above = similarity("fuzzy_match", "kitten", "sitting", pass_threshold=0.6)
    below = similarity("fuzzy_match", "kitten", "sitting", pass_threshold=0.7)
    assert above.reward == below.reward == pytest.approx(1 - 5 / 13)
    assert (above.passed, below.passed) == (True, False)
    assert similarity("fuzzy_match", "kitten", "sitting").passed is None


def test_cosine_uses_the_packaged_model_and_ranks_meaning() -> None:
    paraphrase = similarity("cosine", "The company's revenue increased sharply.", "Sales went up a lot.").reward
    unrelated = similarity("cosine", "The company's revenue increased sharply.", "My cat sleeps on the sofa.").reward
    assert 0.0 <= unrelated < paraphrase <= 1.0


def test_cosine_runs_off_the_event_loop() -> None:
    grader = config(type="text_similarity", input="{{sample.output_text}}", reference="a summary",
                    evaluation_metric="cosine")

    async def grade_while_ticking() -> tuple[GradeResult, int]:
        task = asyncio.create_task(grade(grader, Sample(output_text="a long answer " * 500), {}, GraderContext()))
        ticks = 0
        while not task.done():
            ticks += 1
            await asyncio.sleep(0)
        return task.result(), ticks

    result, ticks = asyncio.run(grade_while_ticking())
    assert raised_flags(result) == []
    assert ticks > 5  # a grader that blocked the loop would let the ticker run once


# ---------------------------------------------------------------- numeric_match

NUMERIC_CASES = [
    # answer, reference, scale, reward
    ("7%", "0.07", None, 1.0),  # percent answer, ratio reference
    ("0.07", "7", "percent", 1.0),  # ratio answer, reference stored as 7 with unit percent
    ("7", "7", "percent", 1.0),  # answer in the reference's unit
    ("7.0 %", "7%", None, 1.0),
    ("The net margin was 12.5 percent.", "0.125", None, 1.0),
    ("(12)", "-12", None, 1.0),  # accounting negative
    ("$-12", "(12)", None, 1.0),
    ("\u22124.5", "-4.5", None, 1.0),  # Unicode minus sign
    ("$1,234.5", "1234.5", None, 1.0),
    ("1.2 million", "1200000", None, 1.0),
    ("3.5bn", "3,500,000,000", None, 1.0),
    ("2.4k", "2400", None, 1.0),
    ("€5.2m", "5200000", None, 1.0),
    ("(£3.1 million)", "-3100000", None, 1.0),
    ("USD 1,000,000", "1", "million", 1.0),
    ("1.2", "1.2", "million", 1.0),  # answer kept the table's unit
    ("25 bps", "0.0025", None, 1.0),
    ("25 bps", "0.25%", None, 1.0),
    ("1e6", "1,000,000", None, 1.0),
    ("Revenue grew from $10m in 2022 to $12.5m.", "12.5", "million", 1.0),  # last number by default
    ("The answer is 42.", "42.0", None, 1.0),
    ("0", "0", None, 1.0),
    ("101", "100", None, 1.0),  # |1| <= 1% of 101
    ("102", "100", None, 0.0),  # |2| > 1% of 102
    ("1,010,000", "1 million", None, 1.0),  # |10,000| <= 1% of 1,010,000
    ("1,011,000", "1 million", None, 0.0),  # |11,000| > 1% of 1,011,000
    ("0.000001", "0", None, 0.0),  # absolute tolerance 1e-9 near zero
    ("12", "-12", None, 0.0),  # wrong sign
    ("7%", "0.7", None, 0.0),  # neither 0.07 nor 7 is 0.7
    ("1.2 billion", "1.2", "million", 0.0),  # explicit wrong scale
    ("I don't know.", "42", None, 0.0),  # no number: a wrong answer, not a grader failure
    ("In FY2023 Q3", "3", None, 0.0),  # digits inside words are not numbers
]


@pytest.mark.parametrize(("answer", "reference", "scale", "reward"), NUMERIC_CASES)
def test_numeric_match_finance_cases(answer: str, reference: str, scale: str | None, reward: float) -> None:
    result = numeric(answer, reference, scale)
    assert result.reward == reward
    assert result.passed is (reward == 1.0)
    assert raised_flags(result) == []


@pytest.mark.parametrize(("pick", "reward"), [("first", 1.0), ("last", 0.0), ("only", 0.0)])
def test_numeric_match_pick(pick: str, reward: float) -> None:
    assert numeric("12 apples and 7 oranges", "12", pick=pick).reward == reward


@pytest.mark.parametrize(("answer", "pick", "reward"), [
    ("In 2023, net income was $66,553 thousand, down 9.6% from 2022.", "first", 1.0),
    ("In 2023, net income was $66,553 thousand.", "only", 1.0),
    ("acme/2023/annual-report.md: net income 66,553 (2022: 70,100)", "first", 1.0),
    ("Net income in 2023: 66553", "last", 1.0),
    ("In 2023 it fell, and in 2022 it rose.", "first", 0.0),  # nothing but years: no number to read
])
def test_numeric_match_ignore_years(answer: str, pick: str, reward: float) -> None:
    assert numeric(answer, "66553", "thousand", pick=pick, ignore_years=True).reward == reward
    if reward:  # without the option the year is read first (or is one of several numbers)
        assert numeric(answer, "66553", "thousand", pick=pick).reward == (1.0 if pick == "last" else 0.0)


def test_numeric_match_ignore_years_keeps_amounts_that_look_like_years() -> None:
    cases = {"$2,023": "2023", "2023.0": "2023", "2023 million": "2023 million", "(2023)": "-2023", "-2023": "-2023"}
    for answer, reference in cases.items():
        assert numeric(f"In 2022: {answer}", reference, pick="last", ignore_years=True).reward == 1.0, answer


def test_numeric_match_pick_only_with_one_number() -> None:
    assert numeric("About 12 apples.", "12", pick="only").reward == 1.0


def test_numeric_match_custom_tolerance() -> None:
    assert numeric("100.4", "100", rel_tol=0, abs_tol=0.5).reward == 1.0
    assert numeric("100.6", "100", rel_tol=0, abs_tol=0.5).reward == 0.0
    assert numeric("105", "100", rel_tol=0.05).reward == 1.0


def test_numeric_match_reference_as_raw_number_from_the_item() -> None:
    result = run({"type": "numeric_match", "reference": "{{item.answer}}"}, "0.00001", {"answer": 1e-05})
    assert result.reward == 1.0


@pytest.mark.parametrize(
    ("reference", "scale", "message"),
    [
        ("n/a", None, "exactly one number"),
        ("between 1 and 2", None, "exactly one number"),
        ("1.2", "dozens", "is not one of"),
        ("1.2 million", "thousand", "already carries a unit"),
    ],
)
def test_numeric_match_bad_reference_is_a_grader_error(reference: str, scale: str | None, message: str) -> None:
    result = numeric("1.2", reference, scale)
    assert result.reward == 0.0
    assert raised_flags(result) == ["other_error"]
    assert message in result.errors["details"]


# ---------------------------------------------------------------- hostile inputs

FIVE_MB = "lorem ipsum dolor sit amet " * 200_000 + "final answer 42"


@pytest.mark.parametrize(
    ("grader", "reward_check"),
    [
        ({"type": "string_check", "input": "{{sample.output_text}}", "reference": "answer 42", "operation": "ilike"},
         lambda r: r == 1.0),
        ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "final answer 42",
          "evaluation_metric": "fuzzy_match"}, lambda r: 0.0 <= r < 0.01),
        ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "final answer 42",
          "evaluation_metric": "rouge_l"}, lambda r: 0.0 <= r < 0.01),
        ({"type": "numeric_match", "reference": "42"}, lambda r: r == 1.0),
    ],
)
def test_five_megabyte_output(grader: dict[str, Any], reward_check: Any) -> None:
    assert len(FIVE_MB) > 5_000_000
    result = run(grader, FIVE_MB)
    assert raised_flags(result) == []
    assert reward_check(result.reward)


@pytest.mark.parametrize("errors", ["surrogateescape", "replace"])
@pytest.mark.parametrize("metric", SIMILARITY_METRICS)
def test_non_utf8_output(metric: str, errors: str) -> None:
    text = b"caf\xe9 total \xff\xfe 42 \xc3\x28".decode("utf-8", errors=errors)
    result = similarity(metric, text, "café total 42")
    assert raised_flags(result) == []
    assert 0.0 <= result.reward <= 1.0


@pytest.mark.parametrize("errors", ["surrogateescape", "replace"])
def test_non_utf8_output_string_check_and_numeric(errors: str) -> None:
    text = b"total \xff\xfe $42 \xed\xa0\x80".decode("utf-8", errors=errors)
    assert string_check("like", text, "$42").reward == 1.0
    assert numeric(text, "42").reward == 1.0


def test_lone_surrogate_from_a_json_escape() -> None:
    text = json.loads('"answer \\ud800 is 42"')
    assert numeric(text, "42").reward == 1.0
    assert raised_flags(similarity("cosine", text, "answer is 42")) == []


DEPTH = 10_000


def test_deeply_nested_json_text_does_not_crash() -> None:
    text = "[" * DEPTH + "]" * DEPTH
    sample = Sample.from_model_sample(text)  # too deep to decode: output_json stays empty
    result = run({"type": "string_check", "input": "{{sample.output_text}}", "reference": "[[[",
                  "operation": "like"}, sample)
    assert result.reward == 1.0
    assert run({"type": "numeric_match", "reference": "1"}, sample).reward == 0.0


def test_deeply_nested_output_json_does_not_crash() -> None:
    nested: dict[str, Any] = {"value": 42}
    for _ in range(DEPTH):
        nested = {"a": nested}
    sample = Sample(output_text="", output_json=nested)
    path = "{{sample.output_json" + ".a" * DEPTH + ".value}}"
    # A path may walk all the way down; rendering the whole of it is refused with a flag, not a crash.
    assert run({"type": "string_check", "input": path, "reference": "42", "operation": "eq"}, sample).reward == 1.0
    whole = {"type": "string_check", "input": "{{sample.output_json}}", "reference": "x", "operation": "eq"}
    result = run(whole, sample)
    assert result.reward == 0.0
    assert raised_flags(result) == ["other_error"]


def test_huge_numbers_do_not_crash() -> None:
    result = numeric("9" * 400, "1e308")
    assert raised_flags(result) == [] and result.reward == 0.0
    assert not math.isnan(numeric("1" * 100_000, "42").reward)
