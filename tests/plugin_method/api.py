"""`method.type = "imitate"` in the control plane: the block, a row rule, the checkpoint score."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.core.config import Settings
from app.core.errors import bad_request
from app.jobs.schemas import Method
from app.jobs.validation import RowProblem, RowRule

TYPE = "imitate"
SCORE_KEYS = (("valid_loss", -1.0),)


class ImitateMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_epochs: int = Field(1, ge=1, le=10)
    learning_rate: float = Field(1e-2, gt=0, le=1)


def _check_row(row: Any) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"]:
        raise RowProblem("missing_text", "each row needs a non-empty 'text'")


def row_rule(declared_tools: set[str]) -> RowRule:
    return _check_row


def stored_block(method: Method, settings: Settings) -> dict[str, Any]:
    try:
        block = ImitateMethod.model_validate(getattr(method, TYPE, None) or {})
    except ValidationError as exc:
        raise bad_request(f"method.imitate is invalid: {exc.errors()[0]['msg']}", param="method.imitate") from None
    return {"type": TYPE, TYPE: block.model_dump()}
