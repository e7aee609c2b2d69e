"""`Idempotency-Key` for object-creating POSTs.

The key is claimed (a unique row) in the same transaction that creates the object, before the
object is created: a concurrent request with the same key waits on the unique index and then
replays the winner's object instead of creating a second one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.errors import APIError, conflict
from app.idempotency.models import IdempotencyRecord

MAX_KEY_LENGTH = 255


def hash_json(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _existing(session: Session, project_id: str, key: str) -> IdempotencyRecord | None:
    return session.scalar(
        select(IdempotencyRecord).where(IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key)
    )


def _replay_target(record: IdempotencyRecord, endpoint: str, request_hash: str) -> str:
    if record.endpoint != endpoint or record.request_hash != request_hash:
        raise conflict(
            "This Idempotency-Key was already used with a different request. Use a new key for a new request.",
            code="idempotency_key_reused",
            param="Idempotency-Key",
        )
    if record.object_id is None:  # pragma: no cover - only visible to a reader outside the transaction
        raise conflict("A request with this Idempotency-Key is still in progress.", code="idempotency_key_in_progress")
    return record.object_id


def claim(session: Session, *, project_id: str, key: str | None, endpoint: str, request_hash: str) -> str | None:
    """None: this request owns the key (or sent none) and should create the object.
    A string: the id of the object an identical earlier request created; replay it."""
    if key is None:
        return None
    if not key or len(key) > MAX_KEY_LENGTH:
        raise APIError(400, f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} characters.", code="invalid_value", param="Idempotency-Key")
    record = _existing(session, project_id, key)
    if record is not None:
        return _replay_target(record, endpoint, request_hash)
    try:
        with session.begin_nested():
            session.add(IdempotencyRecord(project_id=project_id, key=key, endpoint=endpoint, request_hash=request_hash))
    except IntegrityError:
        record = _existing(session, project_id, key)
        if record is None:
            raise
        return _replay_target(record, endpoint, request_hash)
    return None


def complete(session: Session, *, project_id: str, key: str | None, object_id: str) -> None:
    if key is None:
        return
    record = _existing(session, project_id, key)
    if record is not None:
        record.object_id = object_id
