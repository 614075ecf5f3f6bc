"""Hugging Face BERT checkpoints (sentence-transformers models such as all-MiniLM-L6-v2).

    model, tokenizer = hf_bert.load(directory)     # an Encoder, arch="encoder"
    emb_BD = model.embed_sentences(tokens_BT, mask_BT)

config.json -> ModelConfig (post-LayerNorm, erf GELU, biases, learned absolute
positions, token types); the sentence-transformers files next to it, when present,
give the pooling (1_Pooling/config.json) and the longest input (sentence_bert_config.json).
HF stores each layer's nn.Linear as [out, in]; our params are input-axes-first and
stacked over a leading layers axis, as in models/hf_io.py.
"""

import json
import os
import warnings

import numpy as np
from flax import nnx

from models import hf_io
from models.config import ModelConfig
from models.registry import build_from_params
from models.tokenizer import TOKENIZER_FILE, Tokenizer

# Our param path -> (HF name, layout n_in of hf_io.TensorReader).
FLAT = hf_io.FLAT
_GLOBAL = {
    ("embed_VD",): ("embeddings.word_embeddings.weight", 0),
    ("pos_PD",): ("embeddings.position_embeddings.weight", 0),
    ("type_YD",): ("embeddings.token_type_embeddings.weight", 0),
    ("embed_norm", "scale"): ("embeddings.LayerNorm.weight", 0),
    ("embed_norm", "bias"): ("embeddings.LayerNorm.bias", 0),
}
_LAYER = {  # under encoder.layer.{i}.
    ("attn", "wq_DNH"): ("attention.self.query.weight", 1),
    ("attn", "bq_NH"): ("attention.self.query.bias", FLAT),
    ("attn", "wk_DKH"): ("attention.self.key.weight", 1),
    ("attn", "bk_KH"): ("attention.self.key.bias", FLAT),
    ("attn", "wv_DKH"): ("attention.self.value.weight", 1),
    ("attn", "bv_KH"): ("attention.self.value.bias", FLAT),
    ("attn", "wo_NHD"): ("attention.output.dense.weight", 2),
    ("attn", "bo_D"): ("attention.output.dense.bias", 0),
    ("attn_norm", "scale"): ("attention.output.LayerNorm.weight", 0),
    ("attn_norm", "bias"): ("attention.output.LayerNorm.bias", 0),
    ("mlp", "up_DF"): ("intermediate.dense.weight", 1),
    ("mlp", "up_F"): ("intermediate.dense.bias", 0),
    ("mlp", "down_FD"): ("output.dense.weight", 1),
    ("mlp", "down_D"): ("output.dense.bias", 0),
    ("mlp_norm", "scale"): ("output.LayerNorm.weight", 0),
    ("mlp_norm", "bias"): ("output.LayerNorm.bias", 0),
}
# Present in checkpoints but not part of what sentence-transformers computes: the
# BertPooler (tanh dense over [CLS], for next-sentence prediction) and a position-ids buffer.
_UNUSED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")
# Pre-2019 TensorFlow-converted names that transformers still renames on load.
_LEGACY = {".gamma": ".weight", ".beta": ".bias"}
# sentence-transformers pooling modes (legacy bool keys and new names) -> ModelConfig.pooling.
_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
            "mean": "mean", "cls": "cls"}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")
_DTYPES = ("float32", "bfloat16", "float16")


def _read_json(directory, *parts):
  path = os.path.join(directory, *parts)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def pooling_from_st(directory: str) -> str:
  """ModelConfig.pooling from a sentence-transformers 1_Pooling/config.json ("mean" if none)."""
  modules = _read_json(directory, "modules.json") or []
  for m in modules:
    kind = m.get("type", "").rsplit(".", 1)[-1]
    if kind not in _ST_MODULES:
      raise ValueError(f"{directory}/modules.json: module {m.get('type')!r} is not supported; "
                       f"only {_ST_MODULES} (a Dense or other head would change the embedding)")
  if modules and not any(m.get("type", "").endswith("Normalize") for m in modules):
    warnings.warn(f"{directory} has no Normalize module; meshlm's embeddings are L2-normalised "
                  "all the same (cosine similarities are unaffected)")
  pooling_dir = next((m["path"] for m in modules if m.get("type", "").endswith("Pooling")),
                     "1_Pooling")
  cfg = _read_json(directory, pooling_dir, "config.json")
  if cfg is None:
    return "mean"
  modes = cfg.get("pooling_mode")
  if modes is None:
    modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
  modes = [modes] if isinstance(modes, str) else list(modes)
  if len(modes) != 1 or modes[0] not in _POOLING:
    raise ValueError(f"{directory}/{pooling_dir}/config.json: pooling {modes} is not supported;"
                     " only one of mean or cls pooling")
  return _POOLING[modes[0]]


def config_from_hf(hf: dict, source: str = "config.json", pooling: str = "mean",
                   **overrides) -> ModelConfig:
  """ModelConfig(arch="encoder") from a BertModel config.json; what we cannot run is refused."""
  arch = hf.get("architectures") or []
  if hf.get("model_type") != "bert" or any(a != "BertModel" for a in arch):
    raise ValueError(f"{source}: unsupported architecture {arch or hf.get('model_type')!r}; "
                     "only BertModel (model_type 'bert', the bare encoder that "
                     "sentence-transformers saves) is supported")
  checks = (("position_embedding_type", "absolute", "absolute"),
            ("hidden_act", "gelu", "gelu (erf; tanh approximations differ)"),
            ("is_decoder", False, "false"), ("add_cross_attention", False, "false"))
  for key, want, say in checks:
    if hf.get(key, want) != want:
      raise ValueError(f"{source}: {key}={hf[key]!r} is not supported; only {say}")
  heads, d = hf["num_attention_heads"], hf["hidden_size"]
  if d % heads:
    raise ValueError(f"{source}: hidden_size={d} is not a multiple of num_attention_heads={heads}")
  dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
  dtype = dtype if dtype in _DTYPES else "float32"
  values = dict(
      arch="encoder", norm="layer", norm_position="post", mlp_activation="gelu", use_bias=True,
      position="learned", type_vocab_size=hf.get("type_vocab_size", 2),
      vocab_size=hf["vocab_size"], d_model=d, num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=heads, mlp_dim=hf["intermediate_size"],
      max_seq_len=hf.get("max_position_embeddings", 512),
      norm_eps=float(hf.get("layer_norm_eps", 1e-12)), tie_embeddings=True, pooling=pooling,
      param_dtype=dtype, dtype=dtype)
  values.update({k: v for k, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def _canonical(names) -> dict:
  """{our HF name: the checkpoint's name}: drops BertModel's optional "bert." prefix and
  renames legacy gamma/beta."""
  out = {}
  for name in names:
    short = name.removeprefix("bert.")
    for old, new in _LEGACY.items():
      if short.endswith(old):
        short = short[: -len(old)] + new
    out[short] = name
  return out


def params_from_hf(cfg: ModelConfig, abstract_params, read, names) -> dict:
  """{our param path: numpy array in cfg.param_dtype}, checking shapes and leftovers."""
  np_dtype = np.dtype(cfg.jnp_param_dtype)
  tensors, out = hf_io.TensorReader(read, _canonical(names)), {}
  for path, var in nnx.to_flat_state(abstract_params):
    shape = tuple(var.get_value().shape)
    if path in _GLOBAL:
      name, n_in = _GLOBAL[path]
      out[path] = tensors.fetch(name, shape, n_in).astype(np_dtype)
      continue
    if path[0] != "blocks" or path[1:] not in _LAYER:
      raise ValueError(f"parameter {'.'.join(map(str, path))} has no BERT checkpoint equivalent")
    name, n_in = _LAYER[path[1:]]
    out[path] = tensors.stacked("encoder.layer.{}." + name, shape, n_in, np_dtype)
  unexpected = tensors.unused(_UNUSED)
  if unexpected:
    raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) this encoder does not use, "
                     f"e.g. {unexpected[:5]}; refusing to drop them silently (only BertModel "
                     "weights are supported, no task heads)")
  return out


def load_tokenizer(directory: str) -> Tokenizer | None:
  """The tokenizer, its max_len from sentence_bert_config.json (None: no tokenizer.json)."""
  if not os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
    warnings.warn(f"{directory} has no {TOKENIZER_FILE}; returning tokenizer=None")
    return None
  tokenizer = Tokenizer.load(directory)
  st = _read_json(directory, "sentence_bert_config.json") or {}
  if st.get("do_lower_case"):
    raise ValueError(f"{directory}/sentence_bert_config.json: do_lower_case=true is not "
                     "supported (lowercasing belongs in tokenizer.json's normalizer)")
  if st.get("max_seq_length"):
    tokenizer.max_len = int(st["max_seq_length"])
  return tokenizer


def load(directory: str, mesh=None, dtype: str | None = None, param_dtype: str | None = None):
  """(Encoder, Tokenizer | None) from a BertModel / sentence-transformers directory."""
  hf = hf_io.read_config(directory)
  cfg = config_from_hf(hf, source=os.path.join(directory, hf_io.CONFIG_FILE),
                       pooling=pooling_from_st(directory), dtype=dtype, param_dtype=param_dtype)
  tensors = hf_io.SafetensorsDir(directory)
  tokenizer = load_tokenizer(directory)
  if tokenizer is not None and tokenizer.max_len and tokenizer.max_len > cfg.max_seq_len:
    raise ValueError(f"{directory}: max_seq_length={tokenizer.max_len} exceeds "
                     f"max_position_embeddings={cfg.max_seq_len}")
  model = build_from_params(
      cfg, lambda state: params_from_hf(cfg, state, tensors.read, tensors.names), mesh)
  return model, tokenizer
