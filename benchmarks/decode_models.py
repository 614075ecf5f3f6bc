"""Shared by the decode benchmarks: where the SmolLM2-135M-Instruct weights are."""

from models.pretrained import smollm_path

__all__ = ["smollm_path"]
