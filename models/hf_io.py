"""Hugging Face Llama and Mixtral checkpoints: config.json mapping, tensor layout, safetensors I/O.

Our parameters are stored input-axes-first ([D, N, H], [D, F]) and stacked over a
leading layers axis (and, for MoE experts, a second experts axis); Hugging Face stores
each layer's (and each expert's) nn.Linear as [out, in].
Both the safetensors reader and the GGUF reader (models/gguf_io.py) hand tensors
to `params_from_hf` under Hugging Face names, so the layout conversion lives here once.
"""

import glob
import json
import os
import re
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
# In per-layer names "{0}" is the layer index and "{1}" the expert index: each "{}" is
# one leading stacked axis of our param ([L, ...] or [L, E, ...]) that HF stores as
# separate tensors.
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
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", 0),
}
_DENSE_MLP = {
    ("mlp", "gate_DF"): ("mlp.gate_proj.weight", 1),
    ("mlp", "up_DF"): ("mlp.up_proj.weight", 1),
    ("mlp", "down_FD"): ("mlp.down_proj.weight", 1),
}
# Mixtral as published on the Hub, and as transformers 5 still saves it by default.
_MOE_MLP = {
    ("mlp", "router_DE"): ("block_sparse_moe.gate.weight", 1),
    ("mlp", "gate_EDF"): ("block_sparse_moe.experts.{1}.w1.weight", 1),
    ("mlp", "up_EDF"): ("block_sparse_moe.experts.{1}.w3.weight", 1),
    ("mlp", "down_EFD"): ("block_sparse_moe.experts.{1}.w2.weight", 1),
}
# model_type -> (architecture, transformers' defaults for keys a config.json may omit).
_ARCHS = {
    "llama": ("LlamaForCausalLM", dict(rope_theta=10000.0, rms_norm_eps=1e-6,
                                       max_position_embeddings=2048, num_key_value_heads=None)),
    "mixtral": ("MixtralForCausalLM", dict(rope_theta=1e6, rms_norm_eps=1e-5,
                                           max_position_embeddings=131072, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2,
                                           router_aux_loss_coef=0.001)),
}
# ModelConfig fields HF Mixtral cannot express, with the only value export accepts.
_MIXTRAL_FIXED = {
    "shared_mlp_dim": (0, "Mixtral has no shared expert"),
    "router_bias_rate": (0.0, "Mixtral's router has no expert-selection bias"),
    "router_norm": ("topk", "Mixtral renormalises the softmax over the chosen experts"),
}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _first(value):
  return value[0] if isinstance(value, (list, tuple)) else value


def config_from_hf(hf: dict, source: str = "config.json", **overrides) -> ModelConfig:
  """ModelConfig from a Llama or Mixtral config.json; what we cannot run exactly is rejected."""
  arch, model_type = hf.get("architectures") or [], hf.get("model_type")
  if model_type not in _ARCHS or any(a != _ARCHS[model_type][0] for a in arch):
    raise ValueError(f"unsupported architecture {arch or model_type!r} (model_type={model_type!r})"
                     f" in {source}; only LlamaForCausalLM (model_type 'llama'), "
                     "MixtralForCausalLM ('mixtral'), BERT encoders ('bert', models/hf_bert.py) "
                     "and T5ForConditionalGeneration ('t5', models/hf_t5.py) are supported")
  defaults = _ARCHS[model_type][1]

  def get(key):
    return hf.get(key, defaults.get(key))

  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"{source}: {key}=true is not supported (the decoder has no biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
  if hf.get("sliding_window") is not None:
    raise ValueError(f"{source}: sliding_window={hf['sliding_window']!r} is not supported (the "
                     "decoder has no sliding-window attention); only null")
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
      num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
      norm_eps=float(get("rms_norm_eps")),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=get("max_position_embeddings"),
      param_dtype=dtype, dtype=dtype,
      bos_id=_first(hf.get("bos_token_id")), eos_id=_first(hf.get("eos_token_id")))
  if model_type == "mixtral":
    # HF's load-balancing loss is k at uniform load, ours 1, so its coefficient times k
    # gives the same gradient. router_jitter_noise only perturbs HF training: ignored.
    k = get("num_experts_per_tok")
    values.update(num_experts=get("num_local_experts"), top_k=k, router_norm="topk",
                  moe_impl="dropless", aux_loss_weight=float(get("router_aux_loss_coef")) * k)
  values.update({key: v for key, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json for LlamaForCausalLM, or MixtralForCausalLM for an MoE config.

  Readable by transformers 4 (rope_theta) and 5. An MoE config must keep to what
  Mixtral expresses (_MIXTRAL_FIXED); moe_impl="capacity" exports the same weights,
  which transformers then runs dropless.
  """
  if not cfg.plain_llama:
    raise ValueError(
        f"export_hf writes Llama/Mixtral checkpoints; this model (arch={cfg.arch!r}, norm="
        f"{cfg.norm!r}/{cfg.norm_position!r}, mlp_activation={cfg.mlp_activation!r}, position="
        f"{cfg.position!r}, use_bias={cfg.use_bias}, attention_scale={cfg.attention_scale}) would "
        "load as a different model")
  if cfg.sliding_window:
    # Written as is, transformers would run full attention: refuse instead of changing the model.
    raise ValueError(f"model.sliding_window={cfg.sliding_window!r} cannot be exported: "
                     "LlamaForCausalLM/MixtralForCausalLM exports run full attention")
  arch = "mixtral" if cfg.is_moe else "llama"
  hf = {
      "architectures": [_ARCHS[arch][0]], "model_type": arch,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
      "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "dtype": cfg.param_dtype,
  }
  if not cfg.is_moe:
    return {**hf, "attention_bias": False, "mlp_bias": False}
  for field, (allowed, why) in _MIXTRAL_FIXED.items():
    if getattr(cfg, field) != allowed:
      raise ValueError(f"cannot export as MixtralForCausalLM: model.{field}="
                       f"{getattr(cfg, field)!r} ({why}; only {allowed!r} can be exported)")
  return {**hf, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
          "router_aux_loss_coef": cfg.aux_loss_weight / cfg.top_k,  # see config_from_hf
          "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False}


def name_table(cfg: ModelConfig) -> dict:
  """Our param path -> (HF name template, n_in) for this config's architecture."""
  layer = {**_LAYER, **(_MOE_MLP if cfg.is_moe else _DENSE_MLP)}
  return {**_GLOBAL,
          **{("blocks", *path): ("model.layers.{0}." + name, n_in)
             for path, (name, n_in) in layer.items()}}


def lookup_name(table: dict, path: tuple) -> tuple[str, int]:
  """(HF name template, n_in) of param `path` in a `name_table`; ValueError if it has none."""
  if path not in table:  # e.g. MoE extras that config_to_hf rejects first
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no Hugging Face equivalent")
  return table[path]


# transformers 5's in-memory Mixtral layout (what save_pretrained(save_original_format=False)
# writes): per layer mlp.gate.weight [E, D], mlp.experts.gate_up_proj [E, 2F, D] (w1 rows,
# then w3 rows) and mlp.experts.down_proj [E, D, F].
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|"
                    r"experts\.down_proj)")


def _unfuse_experts(cfg: ModelConfig, read: Callable, names: Iterable[str]):
  """(read, names) serving a fused-layout Mixtral checkpoint under the legacy names.

  Keeps the last fused tensor read, so each is read once per parameter that uses it.
  """
  e, f, d = cfg.num_experts, cfg.mlp_dim, cfg.d_model
  virtual, rest = {}, []  # legacy name -> (fused name, index into it, its expected shape)
  for name in names:
    m = _FUSED.fullmatch(name)
    if not m:
      rest.append(name)
      continue
    prefix = f"model.layers.{m[1]}.block_sparse_moe."
    if m[2] == "gate.weight":
      virtual[prefix + "gate.weight"] = (name, (), None)  # fetch checks its shape
      continue
    for j in range(e):
      if m[2] == "experts.down_proj":
        virtual[f"{prefix}experts.{j}.w2.weight"] = (name, (j,), (e, d, f))
      else:
        virtual[f"{prefix}experts.{j}.w1.weight"] = (name, (j, slice(0, f)), (e, 2 * f, d))
        virtual[f"{prefix}experts.{j}.w3.weight"] = (name, (j, slice(f, None)), (e, 2 * f, d))
  cache = {}

  def read_legacy(name):
    if name not in virtual:
      return read(name)
    source, index, shape = virtual[name]
    if source not in cache:
      cache.clear()
      cache[source] = read(source)
      if shape and tuple(cache[source].shape) != shape:
        raise ValueError(f"checkpoint tensor {source!r} has shape "
                         f"{tuple(cache[source].shape)}, but the config implies {shape}")
    return cache[source][index]

  return read_legacy, rest + list(virtual)


FLAT = -1  # layout code: a 1-D checkpoint tensor reshaped to our (multi-axis) shape


class TensorReader:
  """Reads checkpoint tensors into our layouts and remembers which it used.

  Layout `n_in`: n > 0, our first n axes are the checkpoint's last (nn.Linear
  [out, in] -> [in..., out...]); 0, copied as stored; FLAT, a 1-D tensor reshaped.
  `names` is a list of tensor names, or {name we ask for: name in the file}.
  """

  def __init__(self, read: Callable[[str], np.ndarray], names, what: str = "checkpoint"):
    self.read, self.what, self.used = read, what, set()
    self.files = dict(names) if isinstance(names, dict) else {n: n for n in names}

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def fetch(self, name: str, shape: tuple, n_in: int) -> np.ndarray:
    if name not in self.files:
      raise ValueError(f"{self.what} is missing tensor {name!r}")
    self.used.add(name)
    w = self.read(self.files[name])
    if n_in > 0:
      want = (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))
    else:
      want = (int(np.prod(shape)),) if n_in == FLAT else tuple(shape)
    if tuple(w.shape) != want:
      raise ValueError(f"{self.what} tensor {self.files[name]!r} has shape {tuple(w.shape)}, "
                       f"but the config implies {want}")
    return (w.T if n_in > 0 else w).reshape(shape)

  def stacked(self, template: str, shape: tuple, n_in: int, dtype) -> np.ndarray:
    """One array from tensors `template.format(i, ...)`, one per leading index of `shape`
    (a `{}` in the template per axis the file stores as separate tensors, e.g. layers).
    Filled in place, so peak host memory stays about one copy of the weights."""
    stacked = template.count("{")
    arr = np.empty(shape, dtype)
    for index in np.ndindex(*shape[:stacked]):
      arr[index] = self.fetch(template.format(*index), shape[stacked:], n_in)
    return arr

  def unused(self, ignorable=()) -> list[str]:
    """File names of tensors nothing asked for (bar `ignorable`), sorted."""
    return sorted(self.files[n] for n in set(self.files) - self.used - set(ignorable))


def params_from_hf(cfg: ModelConfig, abstract_params, read: Callable[[str], np.ndarray],
                   names: Iterable[str]) -> dict:
  """{our param path: numpy array in cfg.param_dtype}, checking shapes and leftovers."""
  if cfg.is_moe:
    read, names = _unfuse_experts(cfg, read, names)
  np_dtype = np.dtype(cfg.jnp_param_dtype)
  table, tensors, out = name_table(cfg), TensorReader(read, list(names)), {}
  for path, var in nnx.to_flat_state(abstract_params):
    template, n_in = lookup_name(table, path)
    out[path] = tensors.stacked(template, tuple(var.get_value().shape), n_in, np_dtype)
  ignorable = {n for n in tensors.files if n.endswith("rotary_emb.inv_freq")}
  if cfg.tie_embeddings:
    ignorable.add("lm_head.weight")  # some exporters save the tied copy anyway
  unexpected = tensors.unused(ignorable)
  if unexpected:
    raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) this decoder does not use,"
                     f" e.g. {unexpected[:5]}; refusing to drop them silently")
  return out


def params_to_hf(model) -> dict[str, np.ndarray]:
  """{Hugging Face name: numpy array} from a Transformer, in its param dtype."""
  table, tensors = name_table(model.cfg), {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    arr = np.asarray(var.get_value())
    template, n_in = lookup_name(table, path)
    for index in np.ndindex(*arr.shape[:template.count("{")]):
      a = arr[index]
      a = a.reshape(int(np.prod(a.shape[:n_in])), -1).T if n_in else a
      tensors[template.format(*index)] = np.ascontiguousarray(a)
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
  """Writes a transformers-loadable Llama (or, for MoE, Mixtral) directory; all or nothing.

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
