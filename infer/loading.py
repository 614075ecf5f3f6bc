"""One loader for every kind of model path the commands take (generate, serve, eval, ...)."""

import os

from infer.quant.checkpoint import is_quantized_dir, load_quantized
from models import load_pretrained
from train.workdir import is_workdir, load_trained


def load_any(path: str, gguf_quantized: bool = False):
  """(model, tokenizer) from a meshlm workdir, a quantized checkpoint (`meshlm quantize`),
  an HF directory or a .gguf file (kept quantized as stored with `gguf_quantized`).

  Raises FileNotFoundError for a missing path and ValueError/FileNotFoundError (from the
  loaders) for one that is not a model; the commands turn these into exit messages."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"model path {path} does not exist")
  if is_quantized_dir(path):
    return load_quantized(path)
  if is_workdir(path):
    model, tokenizer, _ = load_trained(path)
    return model, tokenizer
  return load_pretrained(path, quantized=gguf_quantized)
