"""Grader configurations as OpenAI defines them, plus the `endpoint` grader.

Pure Pydantic: importable by the API and by the workers alike. This module checks the shape
of a grader; running one is the grader engine's job.
"""

from __future__ import annotations

import ast
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agent_rft.schema_tags import register_union_tags
from agent_rft.urls import check_http_url
from agent_rft.graders.core import GraderError
from agent_rft.graders.templating import check_template


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)


def _valid_template(template: str | None) -> str | None:
    """Creation-time check of a `{{ ... }}` template, so a typo fails the job request, not every rollout."""
    if template is not None:
        try:
            check_template(template)
        except GraderError as error:  # check_template reports unparseable holes as a GraderError
            raise ValueError(error.message) from None
    return template


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    input: str
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"]

    _templates = field_validator("input", "reference")(_valid_template)


SIMILARITY_METRICS = (
    "fuzzy_match", "bleu", "gleu", "meteor", "cosine",
    "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
)


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    input: str
    reference: str
    evaluation_metric: Literal[
        "fuzzy_match", "bleu", "gleu", "meteor", "cosine",
        "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
    ]
    pass_threshold: float | None = None

    _templates = field_validator("input", "reference")(_valid_template)


class NumericMatchGrader(_Grader):
    """This service's extension: the number in the answer equals the reference within a tolerance."""

    type: Literal["numeric_match"]
    input: str = "{{sample.output_text}}"
    reference: str
    # The reference's unit when the item stores it apart: "", thousand, million, billion, trillion, percent.
    scale: str | None = None
    rel_tol: float = Field(0.01, ge=0, le=1)
    abs_tol: float = Field(1e-9, ge=0)
    # Which number of the answer counts when it holds several: the first, the last, or the only one.
    pick: Literal["first", "last", "only"] = "last"
    # Skip bare years ("In 2023, revenue was $5.1 million"): they are rarely the answer and would
    # otherwise be picked as the first (or last) number.
    ignore_years: bool = False
    pass_threshold: float | None = None

    _templates = field_validator("input", "reference", "scale")(_valid_template)


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    type: Literal["message"] | None = None


class ScoreModelGrader(_Grader):
    type: Literal["score_model"]
    model: str = Field(min_length=1)
    input: list[_Message] = Field(min_length=1)
    range: list[float] | None = None
    sampling_params: dict[str, Any] | None = None
    pass_threshold: float | None = None

    @field_validator("range")
    @classmethod
    def _range(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (len(value) != 2 or value[0] >= value[1]):
            raise ValueError("range must be [min, max] with min < max")
        return value


class LabelModelGrader(_Grader):
    type: Literal["label_model"]
    model: str = Field(min_length=1)
    input: list[_Message] = Field(min_length=1)
    labels: list[str] = Field(min_length=1)
    passing_labels: list[str] = Field(min_length=1)

    @field_validator("passing_labels")
    @classmethod
    def _passing_subset(cls, passing: list[str], info: ValidationInfo) -> list[str]:
        unknown = set(passing) - set(info.data.get("labels") or [])
        if unknown:
            raise ValueError(f"passing_labels {sorted(unknown)} are not among labels")
        return passing


PYTHON_SOURCE_MAX_BYTES = 256 * 1024


class PythonGrader(_Grader):
    type: Literal["python"]
    source: str = Field(min_length=1)
    image_tag: str | None = None

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str) -> str:
        size = len(source.encode("utf-8", errors="surrogatepass"))
        if size > PYTHON_SOURCE_MAX_BYTES:  # before parsing: parsing a huge source is the cost
            raise ValueError(f"source is {size:,} bytes of UTF-8; the limit is {PYTHON_SOURCE_MAX_BYTES:,} (256 KiB)")
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise ValueError(f"source does not parse: line {exc.lineno}: {exc.msg}") from None
        if not any(isinstance(n, ast.FunctionDef) and n.name == "grade" for n in tree.body):
            raise ValueError("source must define a top-level function grade(sample, item)")
        return source


class EndpointGrader(_Grader):
    type: Literal["endpoint"]
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    rate_limit: int | None = Field(None, ge=1, description="Requests per second to the grader endpoint.")
    pass_threshold: float | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_http_url(url)


def check_formula(formula: str, names: set[str]) -> None:
    """Parse `calculate_output` with the multi grader's own parser (never evaluated here)."""
    from agent_rft.graders.formula import FormulaError, parse_formula

    try:
        parse_formula(formula, names)
    except FormulaError as exc:
        raise ValueError(f"calculate_output: {exc}") from None


class MultiGrader(_Grader):
    type: Literal["multi"]
    graders: dict[str, "Grader"] = Field(min_length=1)
    calculate_output: str = Field(min_length=1)

    @field_validator("calculate_output")
    @classmethod
    def _formula(cls, formula: str, info: ValidationInfo) -> str:
        check_formula(formula, set(info.data.get("graders") or {}))
        return formula


Grader = Annotated[
    Union[
        StringCheckGrader, TextSimilarityGrader, NumericMatchGrader, ScoreModelGrader, LabelModelGrader,
        PythonGrader, MultiGrader, EndpointGrader,
    ],
    Field(discriminator="type"),
]
MultiGrader.model_rebuild()
GRADER_TYPES = ("string_check", "text_similarity", "numeric_match", "score_model", "label_model", "python", "multi", "endpoint")
register_union_tags(*GRADER_TYPES)
# The types whose own configuration decides `passed` with a pass_threshold.
_OWN_THRESHOLD = frozenset(get_args(model.model_fields["type"].annotation)[0] for model in (
    StringCheckGrader, TextSimilarityGrader, NumericMatchGrader, ScoreModelGrader, LabelModelGrader, PythonGrader,
    MultiGrader, EndpointGrader) if "pass_threshold" in model.model_fields)


def split_pass_threshold(criterion: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """An eval's testing criterion as (its grader's configuration, the pass_threshold it carries
    beside a grader type that has none of its own): OpenAI's criteria take one on any type."""
    body = dict(criterion)
    if body.get("type") in _OWN_THRESHOLD:
        return body, None
    return body, body.pop("pass_threshold", None)
