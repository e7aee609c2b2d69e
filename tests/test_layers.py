"""The workers' layers hold (pyproject.toml's import-linter contracts): a method may import
training, which may import the engine, which may import the models, never upwards; the
supervised and DPO methods, the inference server, the lower layers and the API import nothing of
the reinforcement method."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept():
    linter = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "4 kept, 0 broken" in result.stdout
