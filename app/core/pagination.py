"""Cursor pagination in OpenAI's style: `after` is the id of the last object of the previous page."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from sqlalchemy import Select
from sqlalchemy.orm import Session

from app.core.errors import bad_request

T = TypeVar("T")


class ListPage(BaseModel, Generic[T]):
    object: str = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


def page(
    session: Session,
    stmt: Select[Any],
    model: Any,
    *,
    after: str | None,
    limit: int,
    descending: bool = True,
) -> tuple[list[Any], bool]:
    """Rows of `model` after the cursor, newest first by default; `stmt` carries the scoping filters."""
    if after:
        anchor = session.scalar(stmt.with_only_columns(model.seq).where(model.id == after))
        if anchor is None:
            raise bad_request(f"No object with id '{after}' to page after.", param="after")
        stmt = stmt.where(model.seq < anchor if descending else model.seq > anchor)
    stmt = stmt.order_by(model.seq.desc() if descending else model.seq.asc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit
