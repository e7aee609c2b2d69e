"""OpenAI's `response_format`, checked where it arrives (chat completions, the Responses API's
`text.format`, a reinforcement job's `method.reinforcement.response_format`): `text`,
`json_object`, or `json_schema` with a `name` and a `schema` that the grammar engine compiles (the
one the workers enforce it with, workers/engine/constraints.py), so that a schema no worker could
enforce is a 400 naming the field, never a failure later."""

from __future__ import annotations

from typing import Any

from workers.engine.constraints import UnsupportedFormat, json_grammar


def check_response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """The format as given; ValueError (a pydantic validation error) for one that cannot be enforced."""
    if value is None:
        return None
    kind = value.get("type")
    if kind in ("text", "json_object"):
        if set(value) != {"type"}:
            raise ValueError(f"a '{kind}' response_format has only a type")
        return value
    if kind != "json_schema":
        raise ValueError("type must be 'text', 'json_object' or 'json_schema'")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
        raise ValueError("json_schema needs a 'name' and a 'schema' object")
    try:
        json_grammar(value)
    except UnsupportedFormat as exc:
        raise ValueError(str(exc)) from None
    return value
