"""Stored responses (`store: true`, the SDK's default), readable and chainable within their project."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, BigIntPK, JSONType, utcnow


class StoredResponse(Base):
    __tablename__ = "responses"

    seq: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    # The whole conversation it answered, as input items (a previous response's items first), so that
    # a `previous_response_id` naming it continues from there.
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    body: Mapped[dict[str, Any]] = mapped_column(JSONType)  # the response object as it was answered
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
