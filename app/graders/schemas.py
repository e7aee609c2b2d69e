"""Grader configurations as OpenAI defines them, plus the `endpoint` grader.

Pure Pydantic: importable by the API and by the workers alike. This module checks the shape
of a grader; running one is the grader engine's job.
"""

from __future__ import annotations

import ast
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from app.core.schema_tags import register_union_tags
from app.core.urls import check_http_url


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    input: str
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"]


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


class PythonGrader(_Grader):
    type: Literal["python"]
    source: str = Field(min_length=1)
    image_tag: str | None = None

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str) -> str:
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


_FORMULA_FUNCS = {"min", "max", "abs", "floor", "ceil", "exp", "sqrt", "log"}
_FORMULA_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Load, ast.Constant,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.BitXor, ast.USub, ast.UAdd,
)


def check_formula(formula: str, names: set[str]) -> None:
    """Shape check only (parse tree walked, never evaluated); `^` means power."""
    try:
        tree = ast.parse(formula.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"calculate_output does not parse: {formula!r}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _FORMULA_NODES):
            raise ValueError(f"calculate_output may not contain {type(node).__name__}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
            raise ValueError("calculate_output may only contain numbers")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FORMULA_FUNCS or node.keywords:
                raise ValueError(f"calculate_output may only call {sorted(_FORMULA_FUNCS)}")
        elif isinstance(node, ast.Name) and node.id not in names and node.id not in _FORMULA_FUNCS:
            raise ValueError(f"calculate_output names '{node.id}', which is not one of the graders {sorted(names)}")


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
        StringCheckGrader, TextSimilarityGrader, ScoreModelGrader, LabelModelGrader,
        PythonGrader, MultiGrader, EndpointGrader,
    ],
    Field(discriminator="type"),
]
MultiGrader.model_rebuild()
GRADER_TYPES = ("string_check", "text_similarity", "score_model", "label_model", "python", "multi", "endpoint")
register_union_tags(*GRADER_TYPES)
