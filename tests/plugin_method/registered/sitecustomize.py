"""Put on a worker's PYTHONPATH, this registers the test-only `imitate` method in that process: the
one line a method adds to the workers' registry."""

from workers.methods import METHODS

METHODS["imitate"] = "tests.plugin_method.worker"
