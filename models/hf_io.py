"""Hugging Face Llama checkpoints: config.json mapping, tensor layout, safetensors read/write.

Our parameters are stored input-axes-first ([D, N, H], [D, F]) and stacked over a
leading layers axis; Hugging Face stores each layer's nn.Linear as [out, in].
Both the safetensors reader and the GGUF reader (models/gguf_io.py) hand tensors
to `params_from_hf` under Hugging Face names, so the layout conversion lives here once.
"""

import glob
import json
import os
import shutil
import tempfile
from typing import Callable, Iterable

import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from models.config import ModelConfig

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"

# Our param path -> (Hugging Face name, number of leading "input" axes in our layout).
# 0 means the tensor is copied as is; n > 0 means HF [out, in] <-> ours [in..., out...].
_GLOBAL = {
    ("embed_VD",): ("model.embed_tokens.weight", 0),
    ("final_norm", "scale"): ("model.norm.weight", 0),
    ("unembed_DV",): ("lm_head.weight", 1),
}
_LAYER = {
    ("attn", "wq_DNH"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk_DKH"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv_DKH"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo_NHD"): ("self_attn.o_proj.weight", 2),
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("mlp", "gate_DF"): ("mlp.gate_proj.weight", 1),
    ("mlp", "up_DF"): ("mlp.up_proj.weight", 1),
    ("mlp", "down_FD"): ("mlp.down_proj.weight", 1),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", 0),
}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _first(value):
  return value[0] if isinstance(value, (list, tuple)) else value


def config_from_hf(hf: dict, source: str = "config.json", **overrides) -> ModelConfig:
  """ModelConfig from a Llama config.json dict; anything we cannot run exactly is rejected."""
  arch, model_type = hf.get("architectures") or [], hf.get("model_type")
  if model_type != "llama" or any(a != "LlamaForCausalLM" for a in arch):
    raise ValueError(f"unsupported architecture {arch or model_type!r} (model_type={model_type!r})"
                     f" in {source}; only LlamaForCausalLM (model_type 'llama') is supported")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"{source}: {key}=true is not supported (the decoder has no biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
  # transformers 4 writes rope_theta/rope_scaling; 5 writes rope_parameters.
  rope = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for params in (rope, scaling):
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
      raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported; only plain RoPE")
  heads = hf["num_attention_heads"]
  dtype = _DTYPE_NAMES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), "float32")
  values = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=hf.get("max_position_embeddings", 2048),
      param_dtype=dtype, dtype=dtype,
      bos_id=_first(hf.get("bos_token_id")), eos_id=_first(hf.get("eos_token_id")))
  values.update({k: v for k, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json for LlamaForCausalLM, readable by transformers 4 (rope_theta) and 5."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False, "mlp_bias": False, "bos_token_id": cfg.bos_id,
      "eos_token_id": cfg.eos_id, "dtype": cfg.param_dtype,
  }


def hf_name(path: tuple, layer: int | None = None) -> str:
  if path[0] == "blocks":
    return f"model.layers.{layer}.{_LAYER[path[1:]][0]}"
  return _GLOBAL[path][0]


def _n_in(path: tuple) -> int:
  return _LAYER[path[1:]][1] if path[0] == "blocks" else _GLOBAL[path][1]


def params_from_hf(cfg: ModelConfig, abstract_params, read: Callable[[str], np.ndarray],
                   names: Iterable[str]) -> dict:
  """{our param path: numpy array in cfg.param_dtype}, checking shapes and leftovers."""
  np_dtype = np.dtype(cfg.jnp_param_dtype)
  available, used, out = set(names), set(), {}

  def fetch(name, shape, n_in):
    if name not in available:
      raise ValueError(f"checkpoint is missing tensor {name!r}")
    used.add(name)
    w = read(name)
    want = (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in]))) if n_in else shape
    if tuple(w.shape) != want:
      raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, but the config "
                       f"implies {want}")
    w = w.T if n_in else w  # HF [out, in] -> [in, out]
    return w.reshape(shape)

  for path, var in nnx.to_flat_state(abstract_params):
    shape = tuple(var.get_value().shape)
    if path[0] == "blocks":
      # Fill a preallocated stack so peak host memory is ~one copy of the weights.
      arr = np.empty(shape, np_dtype)
      for i in range(cfg.num_layers):
        arr[i] = fetch(hf_name(path, i), shape[1:], _n_in(path))
    else:
      arr = fetch(hf_name(path), shape, _n_in(path)).astype(np_dtype)
    out[path] = arr
  ignorable = {n for n in available if n.endswith("rotary_emb.inv_freq")}
  if cfg.tie_embeddings:
    ignorable.add("lm_head.weight")  # some exporters save the tied copy anyway
  unexpected = sorted(available - used - ignorable)
  if unexpected:
    raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) this Llama decoder does not use,"
                     f" e.g. {unexpected[:5]}; refusing to drop them silently")
  return out


def params_to_hf(model) -> dict[str, np.ndarray]:
  """{Hugging Face name: numpy array} from a Transformer, in its param dtype."""
  tensors = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    arr, n_in = np.asarray(var.get_value()), _n_in(path)

    def to_hf(a):
      return np.ascontiguousarray(a.reshape(int(np.prod(a.shape[:n_in])), -1).T if n_in else a)

    if path[0] == "blocks":
      for i in range(arr.shape[0]):
        tensors[hf_name(path, i)] = to_hf(arr[i])
    else:
      tensors[hf_name(path)] = to_hf(arr)
  return tensors


class SafetensorsDir:
  """Tensors of a Hugging Face directory, single-file or sharded, read lazily by name."""

  def __init__(self, directory: str):
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      self.files = {n: os.path.join(directory, fn) for n, fn in weight_map.items()}
    else:
      paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
      if not paths:
        found = sorted(os.listdir(directory))[:10]
        raise FileNotFoundError(
            f"{directory} has no *.safetensors weights (found {found}); only safetensors "
            "checkpoints are supported (PyTorch .bin files are not)")
      self.files = {}
      for p in paths:
        with safe_open(p, framework="np") as f:
          self.files.update({n: p for n in f.keys()})
    self._handles = {}

  @property
  def names(self) -> list[str]:
    return list(self.files)

  def read(self, name: str) -> np.ndarray:
    path = self.files[name]
    if path not in self._handles:
      self._handles[path] = safe_open(path, framework="np")
    return self._handles[path].get_tensor(name)


def read_config(directory: str) -> dict:
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{directory} has no {CONFIG_FILE}; expected a Hugging Face model directory "
        "(config.json + *.safetensors) or a .gguf file")
  with open(path) as f:
    return json.load(f)


def _tokenizer_config(tokenizer, cfg: ModelConfig) -> dict:
  text = lambda i: tokenizer.token_text(i) if i is not None else None
  return {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": text(tokenizer.bos_id), "eos_token": text(tokenizer.eos_id),
      "pad_token": text(tokenizer.pad_id), "add_bos_token": bool(tokenizer.add_bos),
      "add_eos_token": False, "clean_up_tokenization_spaces": False,
      "model_max_length": cfg.max_seq_len, "chat_template": tokenizer.chat_template,
  }


def export_hf(model, tokenizer, out_dir: str, *, overwrite: bool = False) -> str:
  """Writes a transformers-loadable LlamaForCausalLM directory; all or nothing.

  Files go to a temporary sibling directory that is renamed into place at the end,
  so a failure leaves `out_dir` as it was. `tokenizer` may be None (weights only).
  """
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
    raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  try:
    cfg = model.cfg
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
      json.dump(config_to_hf(cfg), f, indent=2)
    save_file(params_to_hf(model), os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
      tokenizer.tok.save(os.path.join(tmp, "tokenizer.json"))
      with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump(_tokenizer_config(tokenizer, cfg), f, indent=2)
    if os.path.exists(out_dir):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
      os.rename(out_dir, os.path.join(old, "d"))
      os.rename(tmp, out_dir)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir
