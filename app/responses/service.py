"""Stored responses: a project's own, read, deleted, and continued with `previous_response_id`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import not_found
from app.responses.convert import input_items
from app.responses.models import StoredResponse
from app.responses.schemas import ResponseCreate


def _row(session: Session, project_id: str, response_id: str, *, param: str | None = None) -> StoredResponse:
    row = session.scalar(select(StoredResponse).where(StoredResponse.id == response_id,
                                                      StoredResponse.project_id == project_id))
    if row is None:
        raise not_found("response", response_id, param=param)
    return row


def conversation(*, session: Session, project_id: str, body: ResponseCreate) -> list[dict[str, Any]]:
    """The input items the model answers: the previous response's conversation and output first."""
    items = input_items(body)
    if body.previous_response_id is None:
        return items
    previous = _row(session, project_id, body.previous_response_id, param="previous_response_id")
    return [*previous.input_items, *previous.body["output"], *items]


def store(*, session: Session, project_id: str, items: list[dict[str, Any]], response: dict[str, Any]) -> None:
    session.add(StoredResponse(id=response["id"], project_id=project_id, input_items=items, body=response))


def get(*, session: Session, project_id: str, response_id: str) -> dict[str, Any]:
    return _row(session, project_id, response_id).body


def delete(*, session: Session, project_id: str, response_id: str) -> dict[str, Any]:
    session.delete(_row(session, project_id, response_id))
    return {"id": response_id, "object": "response", "deleted": True}
