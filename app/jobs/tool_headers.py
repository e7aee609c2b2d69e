"""Tool headers at rest. A job's (or diagnostic's) stored `method` keeps every tool header value
sealed, as `{"sealed": "fernet:...", "mask": "****3456"}`: the mask is what the API shows (so
reads need no key), the sealed value is opened only for the worker that claims the run. A plain
string is a value stored before encryption; `agent-rft secrets reencrypt` seals it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.core.crypto import SecretBox

StoredHeader = str | dict[str, str]


def mask_secret(value: str) -> str:
    """Enough to recognise a header value, never enough to use it."""
    return "****" + value[-4:] if len(value) >= 12 else "****"


def masked(stored: StoredHeader) -> str:
    return stored["mask"] if isinstance(stored, dict) else mask_secret(stored)


def _plaintext(stored: StoredHeader, box: SecretBox) -> str:
    return box.open(stored["sealed"] if isinstance(stored, dict) else stored)


def _map_headers(method: dict[str, Any], change: Callable[[StoredHeader], Any]) -> dict[str, Any]:
    """`method` with every tool header value replaced by change(value); the rest as it is."""
    reinforcement = method.get("reinforcement") or {}
    if not reinforcement.get("tools"):
        return method
    tools = [{**tool, "headers": {name: change(value) for name, value in (tool.get("headers") or {}).items()}}
             for tool in reinforcement["tools"]]
    return {**method, "reinforcement": {**reinforcement, "tools": tools}}


def public_headers(method: dict[str, Any]) -> dict[str, Any]:
    return _map_headers(method, masked)


def seal_headers(method: dict[str, Any], box: SecretBox) -> dict[str, Any]:
    """The stored form of a checked method: every header value sealed, with its mask."""
    return _map_headers(method, lambda value: {"sealed": box.seal(value), "mask": mask_secret(value)})


def open_headers(method: dict[str, Any], box: SecretBox) -> dict[str, Any]:
    """The method as the worker uses it: every header value in plain text."""
    return _map_headers(method, lambda stored: _plaintext(stored, box))


def reseal_headers(method: dict[str, Any], box: SecretBox) -> tuple[dict[str, Any], int]:
    """`method` with every header value sealed under the newest key, and how many values changed."""
    changed = 0

    def reseal(stored: StoredHeader) -> StoredHeader:
        nonlocal changed
        if isinstance(stored, str):
            changed += 1
            return {"sealed": box.seal(stored), "mask": mask_secret(stored)}
        resealed = box.reseal(stored["sealed"])
        if resealed is None:
            return stored
        changed += 1
        return {**stored, "sealed": resealed}

    return _map_headers(method, reseal), changed
