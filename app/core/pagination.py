"""Cursor pagination in OpenAI's style: `after` is the id of the last object of the previous page.
One keyset query (`page_by`) serves every list: by insertion order (`page`), or by a composite
key such as a job's rollouts (step, then arrival) or a diagnostic's (sample, then run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from sqlalchemy import Select, tuple_
from sqlalchemy.orm import Session

from app.core.errors import bad_request

T = TypeVar("T")


class ListPage(BaseModel, Generic[T]):
    object: str = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, data: list[T], has_more: bool) -> ListPage[T]:
        """A page of objects that carry an `id`; first_id and last_id are theirs."""
        return cls(data=data, has_more=has_more, first_id=data[0].id if data else None,
                   last_id=data[-1].id if data else None)


def page_by(
    session: Session,
    stmt: Select[Any],
    *,
    order: Sequence[Any],
    cursor: Any,
    after: str | None,
    limit: int,
    descending: bool = True,
    noun: str = "object",
) -> tuple[list[Any], bool]:
    """Rows of `stmt` ordered by the columns `order` (a unique key, compared as a row value),
    after the row whose `cursor` column equals `after`; and whether more follow."""
    if after:
        anchor = session.execute(stmt.with_only_columns(*order).where(cursor == after)).first()
        if anchor is None:
            raise bad_request(f"No {noun} with id '{after}' to page after.", param="after")
        key, mark = tuple_(*order), tuple_(*anchor)
        stmt = stmt.where(key < mark if descending else key > mark)
    stmt = stmt.order_by(*(c.desc() if descending else c.asc() for c in order)).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


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
    return page_by(session, stmt, order=(model.seq,), cursor=model.id, after=after, limit=limit,
                   descending=descending)
