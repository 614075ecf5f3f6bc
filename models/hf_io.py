"""Hugging Face decoder checkpoints: tensor layout and safetensors I/O (each family's
config.json mapping and tensor names: models/families/).

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
# Re-exported: models.pretrained, models.gguf_quant and models.hf_bert reach them through hf_io.
from models.families import (FLAT, PerHead, config_from_hf, config_to_hf,  # noqa: F401
                             family_of, layer_offset, lookup_name, name_table)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"

# transformers 5's in-memory MoE layout (what save_pretrained(save_original_format=False)
# writes): per layer mlp.gate.weight [E, D], mlp.experts.gate_up_proj [E, 2F, D] (gate rows,
# then up rows) and mlp.experts.down_proj [E, D, F].
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|"
                    r"experts\.down_proj)")


def _unfuse_experts(cfg: ModelConfig, read: Callable, names: Iterable[str]):
  """(read, names) serving a fused-layout MoE checkpoint under the family's per-expert names
  (its name_table's: Mixtral's block_sparse_moe.experts.{j}.w1, Qwen's mlp.experts.{j}.gate_proj).

  Keeps the last fused tensor read, so each is read once per parameter that uses it.
  """
  e, f, d = cfg.num_experts, cfg.mlp_dim, cfg.d_model
  table = name_table(cfg)
  named = lambda param, *index: table[("blocks", "mlp", param)][0].format(*index)  # noqa: E731
  virtual, rest = {}, []  # per-expert name -> (fused name, index into it, its expected shape)
  for name in names:
    m = _FUSED.fullmatch(name)
    if not m or (m[2] == "gate.weight" and named("router_DE", int(m[1])) == name):
      rest.append(name)  # not fused, or the router under the family's own name
      continue
    i = int(m[1])
    if m[2] == "gate.weight":
      virtual[named("router_DE", i)] = (name, (), None)  # fetch checks its shape
      continue
    for j in range(e):
      if m[2] == "experts.down_proj":
        virtual[named("down_EFD", i, j)] = (name, (j,), (e, d, f))
      else:
        virtual[named("gate_EDF", i, j)] = (name, (j, slice(0, f)), (e, 2 * f, d))
        virtual[named("up_EDF", i, j)] = (name, (j, slice(f, None)), (e, 2 * f, d))
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

  def stacked(self, template: str, shape: tuple, n_in: int, dtype, offset: int = 0) -> np.ndarray:
    """One array from tensors `template.format(i, ...)`, one per leading index of `shape`
    (a `{}` in the template per axis the file stores as separate tensors, e.g. layers; the
    first index counted from `offset`). Filled in place, so peak host memory stays about one
    copy of the weights."""
    stacked = template.count("{")
    arr = np.empty(shape, dtype)
    for index in np.ndindex(*shape[:stacked]):
      name = template.format(index[0] + offset, *index[1:]) if stacked else template
      arr[index] = self.fetch(name, shape[stacked:], n_in)
    return arr

  def unused(self, ignorable=()) -> list[str]:
    """File names of tensors nothing asked for (bar `ignorable`), sorted."""
    return sorted(self.files[n] for n in set(self.files) - self.used - set(ignorable))


def params_from_hf(cfg: ModelConfig, abstract_params, read: Callable[[str], np.ndarray],
                   names: Iterable[str]) -> dict:
  """{our param path: numpy array in cfg.param_dtype}, checking shapes and leftovers."""
  if cfg.is_moe:
    read, names = _unfuse_experts(cfg, read, names)
  read, names = _split_fused(cfg, read, names)
  np_dtype = np.dtype(cfg.jnp_param_dtype)
  table, tensors, out = name_table(cfg), TensorReader(read, list(names)), {}
  for path, var in nnx.to_flat_state(abstract_params):
    template, n_in = lookup_name(table, path)
    out[path] = tensors.stacked(template, tuple(var.get_value().shape), n_in, np_dtype,
                                layer_offset(cfg, path))
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
    offset = layer_offset(model.cfg, path)
    for index in np.ndindex(*arr.shape[:template.count("{")]):
      a = arr[index]
      if n_in == FLAT:
        a = a.reshape(-1)
      elif n_in:
        a = a.reshape(int(np.prod(a.shape[:n_in])), -1).T
      name = template.format(index[0] + offset, *index[1:]) if index else template
      tensors[name] = np.ascontiguousarray(a)
  for i in range(model.cfg.num_layers):  # the parts of a fused tensor, rows in order
    for fused, parts in _fused_parts(model.cfg).items():
      heads, parts = (parts.heads, parts.parts) if isinstance(parts, PerHead) else (1, parts)
      names = [f"model.layers.{i}.{part}" for part, _ in parts]
      pieces = [tensors.pop(n) for n in names]
      grouped = [p.reshape(heads, -1, *p.shape[1:]) for p in pieces]
      tensors[f"model.layers.{i}.{fused}"] = np.concatenate(grouped, axis=1).reshape(
          -1, *pieces[0].shape[1:])
  return tensors


def _fused_parts(cfg: ModelConfig) -> dict:
  family = family_of(cfg)
  return family.fused(cfg) if family.fused is not None else {}


def _split_fused(cfg: ModelConfig, read: Callable, names: Iterable[str]):
  """(read, names) serving a family's row-fused tensors (Phi-3's qkv_proj) as their parts."""
  fused = _fused_parts(cfg)
  if not fused:
    return read, names
  pattern = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(map(re.escape, fused)) + ")")
  virtual, rest = {}, []  # part name -> (fused name, heads, its rows within a head's)
  parts_of = {}  # fused name -> its parts
  for name in names:
    m = pattern.fullmatch(name)
    if not m:
      rest.append(name)
      continue
    parts = fused[m[2]]
    heads, parts = (parts.heads, parts.parts) if isinstance(parts, PerHead) else (1, parts)
    parts_of[name] = parts
    start = 0
    for part, rows in parts:
      virtual[f"model.layers.{m[1]}.{part}"] = (name, heads, slice(start, start + rows))
      start += rows

  def read_part(name):
    if name not in virtual:
      return read(name)
    source, heads, rows = virtual[name]
    w = read(source)
    want = heads * sum(r for _, r in parts_of[source])
    if w.shape[0] != want:
      raise ValueError(f"checkpoint tensor {source!r} has {w.shape[0]} rows, but the config "
                       f"implies {want} ({heads} heads of {[r for _, r in parts_of[source]]})")
    part = w.reshape(heads, -1, *w.shape[1:])[:, rows]
    return part.reshape(-1, *w.shape[1:])

  return read_part, rest + list(virtual)


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
