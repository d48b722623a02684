"""Training: data, trainer, checkpointing, metrics."""
