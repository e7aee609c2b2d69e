"""The methods' registries: every method the API accepts (app/jobs/methods/) has a module that
trains it on the workers (workers/methods/), each with the same names; a method no worker trains
is a clear error."""

from __future__ import annotations

import importlib

import pytest

from app.jobs.methods import METHODS as API_METHODS
from workers.methods import METHODS as WORKER_METHODS
from workers.methods import method_for


def test_every_method_the_api_accepts_is_trained_by_a_worker_module():
    assert set(API_METHODS) == set(WORKER_METHODS)
    for method_type, module in API_METHODS.items():
        assert module.TYPE == method_type
        assert callable(module.stored_block) and callable(module.row_rule)
        assert module.SCORE_KEYS and all(sign in (1.0, -1.0) for _, sign in module.SCORE_KEYS)
        worker = importlib.import_module(WORKER_METHODS[method_type])
        assert callable(getattr(worker, "train", None)) and callable(getattr(worker, "follow", None))


def test_a_method_no_worker_trains_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot train method.type 'ppo'"):
        method_for("ppo")
