"""Where a job's run is mirrored outside the service (its `integrations`): Weights & Biases."""
