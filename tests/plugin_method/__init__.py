"""A method that exists only for the tests, `imitate`: it shows that adding a training method is a
module per side (`api.py` for the control plane, `worker.py` for the workers) plus a line in each
registry. It trains a model to write each row's `text` (plain cross-entropy), through the shared
training lifecycle and the training layer only."""
