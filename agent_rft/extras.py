"""Which optional extra a code path needs.

`pip install agent-rft` is the control plane alone (API, CLI, dashboard, the graders the API runs):
no torch and no model packages. Training workers need `agent-rft[worker]`, the inference server
`agent-rft[inference]`. A code path that needs a model checks here first, so that a slim install
says what to install instead of failing with an ImportError deep inside a library.
"""

from __future__ import annotations

import importlib.util


def missing_extra(extra: str, what: str, *modules: str) -> str | None:
    """The message to show when a top-level module of `modules` is not installed, else None.

    find_spec only locates the modules: checking never imports torch into the API process."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"{what} needs {', '.join(missing)}, from the '{extra}' extra, which this installation lacks: "
            f"pip install 'agent-rft[{extra}]'")
