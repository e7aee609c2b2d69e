"""Training methods on a worker: how a claimed job of each `method.type` is trained.

`workers/tasks.py::JobRun` owns what every job shares (the claim and its heartbeat, the data, the
starting weights, the final report); a method's module has one entry point, `train(run)`, which
returns the run's `TrainingOutcome`. Adding a method is a module here and a line in `METHODS`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# method.type -> the module that trains it (imported when a job of that method is claimed: torch inside).
METHODS = {
    "reinforcement": "workers.methods.reinforcement",
    "supervised": "workers.methods.supervised",
    "dpo": "workers.methods.dpo",
}


def method_for(method_type: str) -> ModuleType:
    """The module that trains jobs of `method_type`; ValueError for a method this worker cannot train."""
    if method_type not in METHODS:
        raise ValueError(f"this worker cannot train method.type {method_type!r} (it trains {', '.join(METHODS)})")
    return importlib.import_module(METHODS[method_type])
