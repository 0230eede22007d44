"""Training: config, loop, metrics, checkpoints and the per-framework backends."""
