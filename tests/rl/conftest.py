"""Fixtures of the RL engine's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from filelock import FileLock

from tests.rl.trained_adapter import train_tool_calling_adapter


@pytest.fixture(scope="session")
def tool_calling_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's LoRA adapter trained to call the search tool (tests/rl/trained_adapter.py), once a
    run: under pytest-xdist the processes share it through their run's common temporary folder."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return train_tool_calling_adapter(tmp_path_factory.mktemp("tool-calling-adapter"))
    folder = tmp_path_factory.getbasetemp().parent / "tool-calling-adapter"
    with FileLock(f"{folder}.lock"):
        if not (folder / "adapter_config.json").exists():
            train_tool_calling_adapter(folder)
    return folder
