"""The CPU speed-ups of sampling and training: packed and merged weights, fused norms and rotary,
our own kernels, the lean decode step and the training attention. `cpu_speedups.cpu_speedups`
applies them to a model; none is used on a CUDA device."""
