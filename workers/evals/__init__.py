"""Eval runs on a worker: a model over an eval's items with the training engine (a rollout per
item against the run's tools), or given samples, graded by every testing criterion."""
