"""Evals, runs and output items for `/v1/evals` (the worker side is worker_service.py). An eval
holds the item schema and the testing criteria (the grader objects jobs take); a run is one model,
or given samples, over a file's items, executed by the workers under a lease."""

from __future__ import annotations

from collections import Counter
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from agent_rft.graders import schemas as grader_schemas
from agent_rft.graders.templating import check_template, content_text
from agent_rft.ids import new_id
from app.core.config import Settings
from app.core.crypto import secret_box
from app.core.db import unix
from app.core.errors import bad_request, not_found
from app.core.pagination import ListPage, page
from app.core.response_format import check_response_format
from app.evals.models import Eval, EvalOutputItem, EvalRun
from app.evals.schemas import (
    DataSource,
    EvalCreate,
    EvalObject,
    EvalUpdate,
    ModelDataSource,
    OutputItemObject,
    RunCreate,
    RunObject,
)
from app.evals.state import FROM_PUBLIC, RunStatus, public_status, transition
from app.jobs import service as jobs
from app.jobs.lineage import fine_tuned_source, is_fine_tuned
from app.jobs.methods.reinforcement import check_grader, check_tools
from app.jobs.tool_headers import public_grader, public_tools, seal_grader, seal_tools
from app.responses.convert import chat_response_format
from app.serving.service import model_not_found

S = RunStatus
SAMPLE_SCHEMA = {"type": "object", "properties": {
    "model": {"type": "string"}, "choices": {"type": "array"}, "output_text": {"type": "string"},
    "output_tools": {"type": "array"}, "usage": {"type": "object"}}, "required": ["model", "choices"]}
EVAL_FILE_PURPOSES = ("evals", "fine-tune")  # OpenAI's purpose for eval items; a job's files run as they are
_DATA_SOURCE = TypeAdapter(DataSource)
_GRADER = TypeAdapter(grader_schemas.Grader)
_TAGS = {"completions", "responses", "jsonl", "file_content", "file_id", "template", "item_reference"}
_UNION_FIELDS = ("source", "input_messages")  # the data source's fields that are tagged unions


# --- evals --------------------------------------------------------------------------------------


def eval_schema(row: Eval) -> EvalObject:
    config = row.data_source_config
    properties = {"item": config["item_schema"]}
    if config.get("include_sample_schema"):
        properties["sample"] = SAMPLE_SCHEMA
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return EvalObject(id=row.id, created_at=unix(row.created_at), name=row.name,
                      data_source_config={"type": "custom", "schema": schema},
                      testing_criteria=[public_grader(c) for c in row.testing_criteria], metadata=row.user_metadata)


def _checked_config(config: dict[str, Any]) -> dict[str, Any]:
    kind = config.get("type")
    if kind != "custom":
        raise bad_request(f"data_source_config type {kind!r} is not supported here: evals read their items from "
                          "files or inline content ('custom'); 'logs' and 'stored_completions' read OpenAI's own "
                          "stored traffic.", param="data_source_config.type", code="unsupported_value")
    item_schema = config.get("item_schema")
    if not isinstance(item_schema, dict):
        raise bad_request("data_source_config.item_schema must be a JSON schema object.",
                          param="data_source_config.item_schema")
    try:
        validator_for(item_schema).check_schema(item_schema)
    except SchemaError as exc:
        raise bad_request(f"data_source_config.item_schema is not a valid JSON schema: {exc.message}",
                          param="data_source_config.item_schema") from None
    unknown = set(config) - {"type", "item_schema", "include_sample_schema"}
    if unknown:
        raise bad_request(f"Unknown field {sorted(unknown)[0]!r}.", param=f"data_source_config.{sorted(unknown)[0]}")
    return {"type": "custom", "item_schema": item_schema,
            "include_sample_schema": bool(config.get("include_sample_schema", False))}


def _checked_criterion(index: int, criterion: dict[str, Any], settings: Settings, *, param: str) -> dict[str, Any]:
    """A grader object, plus the `pass_threshold` OpenAI's testing criteria may carry on any type."""
    param = f"{param}[{index}]"
    body, threshold = grader_schemas.split_pass_threshold(criterion)
    try:
        grader = _GRADER.validate_python(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:] if isinstance(p, (str, int)))
        raise bad_request(f"Invalid testing criterion: {first['msg']}", param=f"{param}.{where}" if where else param) \
            from None
    check_grader(grader, settings, param=param)
    stored = grader.model_dump(mode="json", exclude_none=True)
    if threshold is not None:
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
            raise bad_request("pass_threshold must be a number.", param=f"{param}.pass_threshold")
        stored["pass_threshold"] = float(threshold)
    return stored


def checked_criteria(criteria: list[dict[str, Any]], settings: Settings, *, param: str = "testing_criteria",
                     taken: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Testing criteria checked as graders, their names unique (results are reported by name)."""
    checked = [_checked_criterion(i, c, settings, param=param) for i, c in enumerate(criteria)]
    names = Counter([*taken, *(c["name"] for c in checked)])
    twice = [name for name, count in names.items() if count > 1]
    if twice:
        raise bad_request(f"Two testing criteria are named {twice[0]!r}; results are reported by name.",
                          param=param, code="duplicate_name")
    return checked


def create_eval(*, session: Session, settings: Settings, project_id: str, body: EvalCreate) -> EvalObject:
    config = _checked_config(body.data_source_config)
    criteria = checked_criteria(body.testing_criteria, settings)
    box = secret_box(settings)
    return eval_schema(add_eval(session, project_id, name=body.name or "eval", config=config,
                                sealed_criteria=[seal_grader(c, box) for c in criteria], metadata=body.metadata))


def add_eval(session: Session, project_id: str, *, name: str, config: dict[str, Any],
             sealed_criteria: list[dict[str, Any]], metadata: dict[str, str] | None = None) -> Eval:
    row = Eval(id=new_id("eval_"), project_id=project_id, name=name, data_source_config=config,
               testing_criteria=sealed_criteria, user_metadata=metadata)
    session.add(row)
    session.flush()
    return row


def eval_row(session: Session, project_id: str, eval_id: str) -> Eval:
    row = session.scalar(select(Eval).where(Eval.id == eval_id, Eval.project_id == project_id))
    if row is None:
        raise not_found("eval", eval_id, param="eval_id")
    return row


def get_eval(*, session: Session, project_id: str, eval_id: str) -> EvalObject:
    return eval_schema(eval_row(session, project_id, eval_id))


def list_evals(*, session: Session, project_id: str, after: str | None, limit: int,
               order: str = "asc") -> ListPage[EvalObject]:
    rows, has_more = page(session, select(Eval).where(Eval.project_id == project_id), Eval, after=after, limit=limit,
                          descending=order == "desc")
    return ListPage[EvalObject].of([eval_schema(r) for r in rows], has_more)


def update_eval(*, session: Session, project_id: str, eval_id: str, body: EvalUpdate) -> EvalObject:
    row = eval_row(session, project_id, eval_id)
    if body.name is not None:
        row.name = body.name
    if "metadata" in body.model_fields_set:
        row.user_metadata = body.metadata
    return eval_schema(row)


def delete_eval(*, session: Session, project_id: str, eval_id: str) -> None:
    """The eval, its runs and their output items. A worker running one of them loses its lease."""
    row = eval_row(session, project_id, eval_id)
    run_ids = select(EvalRun.id).where(EvalRun.eval_id == row.id)
    session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_id.in_(run_ids)))
    session.execute(delete(EvalRun).where(EvalRun.eval_id == row.id))
    session.delete(row)


# --- runs ---------------------------------------------------------------------------------------


def run_schema(row: EvalRun) -> RunObject:
    result = row.result or {}
    return RunObject(
        id=row.id, eval_id=row.eval_id, created_at=unix(row.created_at), name=row.name, model=row.model,
        status=public_status(row.status), data_source=public_data_source(row.data_source),
        error=row.error and {"code": row.error.get("code") or "error", "message": row.error.get("message") or ""},
        metadata=row.user_metadata, result_counts=result.get("result_counts") or {},
        per_testing_criteria_results=result.get("per_testing_criteria_results") or [],
        per_model_usage=result.get("per_model_usage") or [],
        report_url=f"/dashboard/evals/{row.eval_id}?run={row.id}", x_items_total=row.items_total)


def public_data_source(data_source: dict[str, Any]) -> dict[str, Any]:
    agent = data_source.get("x_open_model")
    if not agent or not agent.get("tools"):
        return data_source
    return {**data_source, "x_open_model": {**agent, "tools": public_tools(agent["tools"])}}


def _param_of(loc: tuple[Any, ...]) -> str:
    """A data source's validation error location as a request param. Pydantic names the member of a
    tagged union by its tag right where the union stands (the data source itself, its `source`, its
    `input_messages`): those tags are dropped, and only there (`template` is also a field's name)."""
    param = "data_source"
    for i, part in enumerate(loc):
        if part in _TAGS and (i == 0 or loc[i - 1] in _UNION_FIELDS):
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif "[" not in str(part):
            param += f".{part}"
    return param


def _checked_data_source(raw: dict[str, Any]) -> Any:
    kind, source = raw.get("type"), (raw.get("source") or {}).get("type") if isinstance(raw.get("source"), dict) else None
    if kind not in ("completions", "responses", "jsonl"):
        raise bad_request(f"data_source type {kind!r} is not supported; use 'completions', 'responses' or 'jsonl'.",
                          param="data_source.type", code="unsupported_value")
    if source in ("stored_completions", "responses"):
        raise bad_request(f"source type {source!r} reads OpenAI's stored traffic and is not supported here; give "
                          "'file_id' or 'file_content'.", param="data_source.source.type", code="unsupported_value")
    try:
        return _DATA_SOURCE.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param_of(tuple(first["loc"]))
        code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
        raise bad_request(f"Invalid value for '{param}': {first['msg'].removeprefix('Value error, ')}", param=param,
                          code=code) from None


def _check_model_source(session: Session, project_id: str, source: ModelDataSource) -> None:
    if is_fine_tuned(source.model) and fine_tuned_source(session, project_id, source.model) is None:
        error = model_not_found(source.model)
        error.param = "data_source.model"
        raise error
    if source.input_messages is None:
        raise bad_request("input_messages is required: a 'template' of messages with {{item.*}} holes, or an "
                          "'item_reference' such as 'item.messages'.", param="data_source.input_messages",
                          code="missing_required_parameter")
    if source.input_messages.type == "template":
        for i, message in enumerate(source.input_messages.template):
            try:
                check_template(content_text(message.content))
            except ValueError as exc:
                raise bad_request(str(exc), param=f"data_source.input_messages.template[{i}].content") from None
    elif not source.input_messages.item_reference.startswith("item."):
        raise bad_request("item_reference must name a field of the item, e.g. 'item.messages'.",
                          param="data_source.input_messages.item_reference")
    params = source.sampling_params
    for value, param in ((params.response_format, "response_format"), (chat_response_format((params.text or {}).get(
            "format")) if params.text else None, "text.format")):
        try:
            check_response_format(value)
        except ValueError as exc:
            raise bad_request(f"Invalid {param}: {exc}", param=f"data_source.sampling_params.{param}") from None


def _check_source_rows(source: Any, data: Any) -> int | None:
    """Items of an inline source (None for a file: the worker counts them)."""
    if source.type != "file_content":
        return None
    if data.type == "jsonl":
        for i, row in enumerate(source.content):
            if row.sample is None:
                raise bad_request("A jsonl run grades given samples: every row needs a 'sample'.",
                                  param=f"data_source.source.content[{i}].sample", code="missing_required_parameter")
    return len(source.content)


def create_run(*, session: Session, settings: Settings, project_id: str, eval_id: str, body: RunCreate) -> RunObject:
    evaluation = eval_row(session, project_id, eval_id)
    data = _checked_data_source(body.data_source)
    if data.source.type == "file_id":
        jobs.check_file(session, project_id, data.source.id, "data_source.source.id", purposes=EVAL_FILE_PURPOSES)
    items = _check_source_rows(data.source, data)
    stored = data.model_dump(mode="json", exclude_none=True)
    model = ""
    if isinstance(data, ModelDataSource):
        _check_model_source(session, project_id, data)
        check_tools(data.x_open_model.tools, settings, param="data_source.x_open_model.tools")
        stored["x_open_model"]["tools"] = seal_tools(stored["x_open_model"]["tools"], secret_box(settings))
        model = data.model
        if items is not None:
            items *= data.x_open_model.samples_per_item
    return run_schema(add_run(session, evaluation, name=body.name or f"{model or 'jsonl'} run", model=model,
                              data_source=stored, items_total=items, metadata=body.metadata))


def add_run(session: Session, evaluation: Eval, *, name: str, model: str, data_source: dict[str, Any],
            items_total: int | None = None, metadata: dict[str, str] | None = None) -> EvalRun:
    """A queued run of `evaluation` on a checked data source (tool header values sealed)."""
    row = EvalRun(id=new_id("evalrun_"), eval_id=evaluation.id, project_id=evaluation.project_id, name=name,
                  model=model, data_source=data_source, user_metadata=metadata, status=S.QUEUED.value,
                  items_total=items_total)
    session.add(row)
    session.flush()
    return row


def run_row(session: Session, project_id: str, eval_id: str, run_id: str, *, for_update: bool = False) -> EvalRun:
    stmt = select(EvalRun).where(EvalRun.id == run_id, EvalRun.eval_id == eval_id, EvalRun.project_id == project_id)
    row = session.scalar(stmt.with_for_update() if for_update else stmt)
    if row is None:
        raise not_found("eval run", run_id, param="run_id")
    return row


def get_run(*, session: Session, project_id: str, eval_id: str, run_id: str) -> RunObject:
    return run_schema(run_row(session, project_id, eval_id, run_id))


def list_runs(*, session: Session, project_id: str, eval_id: str, after: str | None, limit: int, order: str = "asc",
              status: str | None = None) -> ListPage[RunObject]:
    eval_row(session, project_id, eval_id)
    stmt = select(EvalRun).where(EvalRun.eval_id == eval_id, EvalRun.project_id == project_id)
    if status is not None:
        if status not in FROM_PUBLIC:
            raise bad_request(f"status must be one of {sorted(FROM_PUBLIC)}.", param="status")
        stmt = stmt.where(EvalRun.status == FROM_PUBLIC[status].value)
    rows, has_more = page(session, stmt, EvalRun, after=after, limit=limit, descending=order == "desc")
    return ListPage[RunObject].of([run_schema(r) for r in rows], has_more)


def cancel_run(*, session: Session, project_id: str, eval_id: str, run_id: str) -> RunObject:
    """What ran so far stays readable; the worker stops at its next heartbeat."""
    row = run_row(session, project_id, eval_id, run_id, for_update=True)
    transition(session, row, S.CANCELLED, action="cancel")
    refresh_result(session, row)
    return run_schema(row)


def delete_run(*, session: Session, project_id: str, eval_id: str, run_id: str) -> None:
    row = run_row(session, project_id, eval_id, run_id, for_update=True)
    session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_id == row.id))
    session.delete(row)


# --- output items ---------------------------------------------------------------------------------


def item_schema(row: EvalOutputItem) -> OutputItemObject:
    return OutputItemObject(
        id=row.id, eval_id=row.eval_id, run_id=row.run_id, created_at=unix(row.created_at), status=row.status,
        datasource_item_id=row.item_index, datasource_item=row.datasource_item, results=row.results,
        sample=row.sample, x_sample_index=row.sample_index, x_trace_id=row.trace_id, x_trajectory=row.trajectory)


def list_output_items(*, session: Session, project_id: str, eval_id: str, run_id: str, after: str | None, limit: int,
                      order: str = "asc", status: str | None = None) -> ListPage[OutputItemObject]:
    run_row(session, project_id, eval_id, run_id)
    stmt = select(EvalOutputItem).where(EvalOutputItem.run_id == run_id)
    if status is not None:
        if status not in ("pass", "fail", "error"):
            raise bad_request("status must be 'pass', 'fail' or 'error'.", param="status")
        stmt = stmt.where(EvalOutputItem.status == status)
    rows, has_more = page(session, stmt, EvalOutputItem, after=after, limit=limit, descending=order == "desc")
    return ListPage[OutputItemObject].of([item_schema(r) for r in rows], has_more)


def get_output_item(*, session: Session, project_id: str, eval_id: str, run_id: str,
                    output_item_id: str) -> OutputItemObject:
    run_row(session, project_id, eval_id, run_id)
    row = session.scalar(select(EvalOutputItem).where(EvalOutputItem.run_id == run_id,
                                                      EvalOutputItem.id == output_item_id))
    if row is None:
        raise not_found("output item", output_item_id, param="output_item_id")
    return item_schema(row)


# --- results --------------------------------------------------------------------------------------


def refresh_result(session: Session, run: EvalRun) -> None:
    """result_counts, per_testing_criteria_results and per_model_usage from every stored item."""
    session.flush()
    counts = dict(session.execute(select(EvalOutputItem.status, func.count()).where(EvalOutputItem.run_id == run.id)
                                  .group_by(EvalOutputItem.status)).all())
    per_criterion: dict[str, list[int]] = {}
    usage = Counter()
    invocations = 0
    for results, sample in session.execute(select(EvalOutputItem.results, EvalOutputItem.sample)
                                           .where(EvalOutputItem.run_id == run.id)):
        for result in results:
            tally = per_criterion.setdefault(result["name"], [0, 0])
            tally[0 if result.get("passed") else 1] += 1
        for key in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"):
            usage[key] += int((sample.get("usage") or {}).get(key) or 0)
        invocations += int((sample.get("usage") or {}).get("x_invocations") or 0)
    run.result = {
        "result_counts": {"total": sum(counts.values()), "passed": counts.get("pass", 0),
                          "failed": counts.get("fail", 0), "errored": counts.get("error", 0)},
        "per_testing_criteria_results": [{"testing_criteria": name, "passed": p, "failed": f}
                                         for name, (p, f) in per_criterion.items()],
        "per_model_usage": [{"model_name": run.model, "invocation_count": invocations, **{
            k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")}}]
        if run.model else [],
    }
