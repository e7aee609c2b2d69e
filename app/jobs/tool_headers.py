"""Header values at rest: what a job (or diagnostic) sends to its tool servers
(`method.reinforcement.tools[].headers`) and to its endpoint graders (the `headers` of any grader
in `method.reinforcement.grader`, a multi grader's sub-graders included). The stored `method`
keeps every such value sealed, as `{"sealed": "fernet:...", "mask": "****3456"}`: the mask is what
the API shows (so reads need no key), the sealed value is opened only for the worker that claims
the run. A plain string is a value stored before encryption: `agent-rft secrets reencrypt` seals
a tool's, migration 0010 a grader's."""

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


def _sealed(plaintext: str, box: SecretBox) -> dict[str, str]:
    return {"sealed": box.seal(plaintext), "mask": mask_secret(plaintext)}


def _plaintext(stored: StoredHeader, box: SecretBox) -> str:
    return box.open(stored["sealed"] if isinstance(stored, dict) else stored)


def _map_grader(grader: Any, change: Callable[[StoredHeader], Any]) -> Any:
    """`grader` with every header value replaced by change(value), its sub-graders' too (any grader
    type that carries `headers` is covered, not only `endpoint`: a secret is a secret)."""
    if not isinstance(grader, dict):
        return grader
    mapped = dict(grader)
    if isinstance(grader.get("headers"), dict):
        mapped["headers"] = {name: change(value) for name, value in grader["headers"].items()}
    if isinstance(grader.get("graders"), dict):
        mapped["graders"] = {name: _map_grader(sub, change) for name, sub in grader["graders"].items()}
    return mapped


def _map_tool(tool: dict[str, Any], change: Callable[[StoredHeader], Any]) -> dict[str, Any]:
    return {**tool, "headers": {name: change(value) for name, value in (tool.get("headers") or {}).items()}}


def _map_headers(method: dict[str, Any], change: Callable[[StoredHeader], Any], *,
                 graders_only: bool = False) -> dict[str, Any]:
    """`method` with every header value (its graders' only, if told) replaced by change(value)."""
    reinforcement = method.get("reinforcement") or {}
    if not reinforcement:
        return method
    mapped = dict(reinforcement)
    if "grader" in reinforcement:
        mapped["grader"] = _map_grader(reinforcement["grader"], change)
    if reinforcement.get("tools") and not graders_only:
        mapped["tools"] = [_map_tool(tool, change) for tool in reinforcement["tools"]]
    return {**method, "reinforcement": mapped}


def _rewrite(method: dict[str, Any], change: Callable[[StoredHeader], StoredHeader | None], *,
             graders_only: bool) -> tuple[dict[str, Any], int]:
    """`method` with every header value replaced by change(value) unless that is None, and how many were."""
    changed = 0

    def counted(stored: StoredHeader) -> StoredHeader:
        nonlocal changed
        new = change(stored)
        if new is None:
            return stored
        changed += 1
        return new

    return _map_headers(method, counted, graders_only=graders_only), changed


def public_grader(grader: dict[str, Any]) -> dict[str, Any]:
    """A grader as the API shows it: header values masked."""
    return _map_grader(grader, masked)


def seal_grader(grader: dict[str, Any], box: SecretBox) -> dict[str, Any]:
    """A checked grader outside a job (an eval's testing criterion): header values sealed."""
    return _map_grader(grader, lambda value: _sealed(value, box))


def open_grader(grader: dict[str, Any], box: SecretBox) -> dict[str, Any]:
    return _map_grader(grader, lambda stored: _plaintext(stored, box))


def seal_tools(tools: list[dict[str, Any]], box: SecretBox) -> list[dict[str, Any]]:
    """Tool endpoints outside a job (an eval run's): header values sealed."""
    return [_map_tool(tool, lambda value: _sealed(value, box)) for tool in tools]


def open_tools(tools: list[dict[str, Any]], box: SecretBox) -> list[dict[str, Any]]:
    return [_map_tool(tool, lambda stored: _plaintext(stored, box)) for tool in tools]


def public_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_map_tool(tool, masked) for tool in tools]


def public_headers(method: dict[str, Any]) -> dict[str, Any]:
    return _map_headers(method, masked)


def seal_headers(method: dict[str, Any], box: SecretBox) -> dict[str, Any]:
    """The stored form of a checked method: every header value sealed, with its mask."""
    return _map_headers(method, lambda value: _sealed(value, box))


def open_headers(method: dict[str, Any], box: SecretBox) -> dict[str, Any]:
    """The method as the worker uses it: every header value in plain text."""
    return _map_headers(method, lambda stored: _plaintext(stored, box))


def header_values(method: dict[str, Any], *, graders_only: bool = False) -> list[StoredHeader]:
    """Every stored header value of `method` (its graders' only, if told), sealed or plain."""
    found: list[StoredHeader] = []
    _rewrite(method, lambda stored: found.append(stored), graders_only=graders_only)  # append: None, unchanged
    return found


def reseal_headers(method: dict[str, Any], box: SecretBox, *,
                   graders_only: bool = False) -> tuple[dict[str, Any], int]:
    """`method` with every header value sealed under the newest key, and how many values changed."""

    def reseal(stored: StoredHeader) -> StoredHeader | None:
        if isinstance(stored, str):
            return _sealed(stored, box)
        resealed = box.reseal(stored["sealed"])
        return None if resealed is None else {**stored, "sealed": resealed}

    return _rewrite(method, reseal, graders_only=graders_only)


def unseal_headers(method: dict[str, Any], box: SecretBox, *,
                   graders_only: bool = False) -> tuple[dict[str, Any], int]:
    """`method` with every sealed header value in plain text again (for going back to a revision
    that reads them so), and how many values changed."""
    return _rewrite(method, lambda stored: _plaintext(stored, box) if isinstance(stored, dict) else None,
                    graders_only=graders_only)
