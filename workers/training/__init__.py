"""What every training method shares: the run's lifecycle (steps, pause and cancel, checkpoints,
resumable state), the seeded data stream, training sequences and their log-probs, and the
data-parallel training processes. The methods themselves are workers/methods/."""
