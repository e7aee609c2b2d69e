"""`method.type = "dpo"` in the control plane: the block stored with every default filled in (the
worker reads it as stored), a row of its files (a conversation and two answers to it, one
preferred; docs/dpo.md), and how its checkpoints rank (validation loss, lower is better)."""

from __future__ import annotations

from typing import Any

from app.core.config import Settings
from app.jobs.schemas import DpoMethod, Method
from app.jobs.validation import RowRule, check_preference_row

TYPE = "dpo"
SCORE_KEYS = (("valid_loss", -1.0),)


def row_rule(declared_tools: set[str]) -> RowRule:
    return check_preference_row  # a conversation brings its own tools


def stored_block(method: Method, settings: Settings) -> dict[str, Any]:
    return {"type": TYPE, TYPE: (method.dpo or DpoMethod()).model_dump(mode="json")}
