"""The variance diagnostic: every sample run several times before training, to show where
learning can happen (samples with mixed scores) and where it cannot (always 0, always 1)."""
