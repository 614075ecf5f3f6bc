"""Inference: sampling from a trained or imported model."""

from infer.sampling import generate
