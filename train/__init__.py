"""Pretraining: data pipeline, optimizer, jitted steps, checkpoints, metrics and the loop."""
