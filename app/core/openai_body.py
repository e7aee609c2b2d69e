"""A JSON body read the way OpenAI's API reads it: an object, no field it does not know (400
`unsupported_parameter` naming the first), each field checked (400 naming it), and no field set
to a value this service does not implement (the model's `unsupported_field()`)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.core.errors import APIError, bad_request

Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], body: Any) -> Body:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", code="unsupported_parameter",
                       param=unknown[0])
    try:
        checked = model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    unsupported = checked.unsupported_field() if hasattr(checked, "unsupported_field") else None
    if unsupported:
        raise APIError(400, f"'{unsupported}' is not supported by this service (only its default value is accepted).",
                       code="unsupported_parameter", param=unsupported)
    return checked
