"""Fixtures of the RL engine's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl.trained_adapter import train_tool_calling_adapter


@pytest.fixture(scope="session")
def tool_calling_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's LoRA adapter trained to call the search tool (tests/rl/trained_adapter.py), once a run."""
    return train_tool_calling_adapter(tmp_path_factory.mktemp("tool-calling-adapter"))
