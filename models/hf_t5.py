"""Hugging Face T5 checkpoints (T5ForConditionalGeneration) -> EncoderDecoder.

    model, tokenizer = hf_t5.load("path/to/t5-small")   # config.json + *.safetensors

config.json maps onto ModelConfig(arch="encoder_decoder", norm="rms", position="relative",
attention_scale=1.0, use_bias=False); `bos_id` holds the decoder start token (T5: pad, 0).
Tensors go by name into our layout: a torch Linear is [out, in], ours input axes first
([D, N, H], [D, F]), with the per-layer tensors stacked on a leading layers axis.

The output head. Original T5 ties lm_head to `shared` and scales the decoder output by
d_model**-0.5; T5 v1.1 has its own lm_head and no scale. transformers 5 always writes
tie_word_embeddings=true and says which with `scale_decoder_outputs` (older configs:
tie_word_embeddings=false means v1.1), saving lm_head.weight only when it differs from
`shared`. So: scaled and no separate lm_head -> tie_embeddings=True (exactly T5); anything
else -> a separate unembed_DV holding lm_head (or `shared` when absent), the scale, if any,
folded into it.
"""

import os
import warnings

import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.encoder_decoder import EncoderDecoder
from models.hf_io import CONFIG_FILE, SafetensorsDir, TensorReader, read_config
from models.registry import build_from_params
from models.tokenizer import TOKENIZER_FILE, Tokenizer

ARCHITECTURE = "T5ForConditionalGeneration"
_DTYPES = ("float32", "bfloat16", "float16")
# (HF dense_act_fn, gated) -> our mlp_activation. gelu_new is tanh-GELU, as our "geglu".
_ACTIVATIONS = {("relu", False): "relu", ("gelu", False): "gelu",
                ("gelu_new", True): "geglu", ("silu", True): "swiglu"}
_SUPPORTED_FF = "'relu', 'gelu', 'gated-gelu' (T5 v1.1, tanh GELU) and 'gated-silu'"

# Our param path -> (HF name, n_in): n_in > 0 means HF [out, in] -> ours [in..., out...]
# with n_in leading input axes; 0 copies as is. "{0}" is the layer index.
_ATTN = {"wq_DNH": ("q", 1), "wk_DKH": ("k", 1), "wv_DKH": ("v", 1), "wo_NHD": ("o", 2)}
_MLP = {False: {"up_DF": "wi", "down_FD": "wo"},  # act(wi x), then wo
        True: {"gate_DF": "wi_0", "up_DF": "wi_1", "down_FD": "wo"}}  # act(wi_0 x) * wi_1 x


def _feed_forward(hf: dict, source: str) -> str:
  """mlp_activation for `feed_forward_proj`, read as transformers' T5Config reads it."""
  proj = hf.get("feed_forward_proj", "relu")
  parts = proj.split("-")
  act, gated = parts[-1], parts[0] == "gated" and len(parts) == 2
  if proj == "gated-gelu":
    act = "gelu_new"  # transformers' backward-compatible meaning of "gated-gelu"
  if len(parts) > 2 or (len(parts) == 2 and not gated) or (act, gated) not in _ACTIVATIONS:
    raise ValueError(f"{source}: feed_forward_proj={proj!r} is not supported; supported: "
                     f"{_SUPPORTED_FF}")
  return _ACTIVATIONS[act, gated]


def config_from_hf(hf: dict, source: str = CONFIG_FILE, *, separate_head: bool = False,
                   **overrides) -> ModelConfig:
  """ModelConfig from a T5 config.json; `separate_head`: the checkpoint's lm_head differs
  from `shared` (see the module docstring). Raises on what we cannot run exactly."""
  arch, model_type = hf.get("architectures") or [], hf.get("model_type")
  if model_type != "t5" or any(a != ARCHITECTURE for a in arch):
    raise ValueError(f"unsupported architecture {arch or model_type!r} (model_type="
                     f"{model_type!r}) in {source}; hf_t5 loads {ARCHITECTURE} (model_type 't5')")
  first = lambda v: v[0] if isinstance(v, (list, tuple)) else v  # noqa: E731
  pad = hf.get("pad_token_id", 0)
  start = hf.get("decoder_start_token_id")
  dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
  dtype = dtype if dtype in _DTYPES else "float32"
  heads = hf.get("num_heads", 8)
  values = dict(
      arch="encoder_decoder", norm="rms", norm_position="pre", use_bias=False,
      position="relative", attention_scale=1.0,  # T5 folds 1/sqrt(d_kv) into its init
      mlp_activation=_feed_forward(hf, source),
      vocab_size=hf.get("vocab_size", 32128), d_model=hf.get("d_model", 512),
      head_dim=hf.get("d_kv", 64), num_heads=heads, num_kv_heads=heads,
      mlp_dim=hf.get("d_ff", 2048), num_layers=hf.get("num_layers", 6),
      num_decoder_layers=hf.get("num_decoder_layers") or 0,
      decoder_vocab_size=hf.get("decoder_vocab_size") or 0,
      relative_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_max_distance=hf.get("relative_attention_max_distance", 128),
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
      tie_embeddings=not separate_head and scales_output(hf),
      # Relative positions have no hard limit; this only sizes engines by default.
      max_seq_len=hf.get("n_positions") or 512,
      bos_id=start if start is not None else pad, eos_id=first(hf.get("eos_token_id", 1)),
      param_dtype=dtype, dtype=dtype)
  values.update({k: v for k, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def scales_output(hf: dict) -> bool:
  """Whether the decoder output is multiplied by d_model**-0.5 (original T5), as transformers
  decides: `scale_decoder_outputs` if written, else unless tie_word_embeddings is false."""
  if "scale_decoder_outputs" in hf:
    return bool(hf["scale_decoder_outputs"])
  return hf.get("tie_word_embeddings", True) is not False


def name_table(cfg: ModelConfig) -> dict:
  """Our param path -> (HF name template, n_in) for a T5 of this config."""
  mlp = _MLP[cfg.mlp_activation in ("geglu", "swiglu")]
  table = {("embed_VD",): ("shared.weight", 0),
           ("enc_norm", "scale"): ("encoder.final_layer_norm.weight", 0),
           ("final_norm", "scale"): ("decoder.final_layer_norm.weight", 0),
           ("unembed_DV",): ("lm_head.weight", 1)}
  stacks = {"enc_blocks": ("encoder", {"attn": 0}, 1),
            "blocks": ("decoder", {"attn": 0, "cross_attn": 1}, 2)}
  for ours, (stack, attns, ff) in stacks.items():
    rel = "enc_rel_bias" if stack == "encoder" else "dec_rel_bias"
    table[(rel, "table_RN")] = (  # [buckets, heads], held by block 0 only
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", 0)
    prefix = stack + ".block.{0}.layer."
    for attn, i in attns.items():
      kind = "SelfAttention" if attn == "attn" else "EncDecAttention"
      norm = "attn_norm" if attn == "attn" else "cross_norm"
      table[(ours, norm, "scale")] = (f"{prefix}{i}.layer_norm.weight", 0)
      for w, (hf_w, n_in) in _ATTN.items():
        table[(ours, attn, w)] = (f"{prefix}{i}.{kind}.{hf_w}.weight", n_in)
    table[(ours, "mlp_norm", "scale")] = (f"{prefix}{ff}.layer_norm.weight", 0)
    for w, hf_w in mlp.items():
      table[(ours, "mlp", w)] = (f"{prefix}{ff}.DenseReluDense.{hf_w}.weight", 1)
  return table


def params_from_hf(cfg: ModelConfig, abstract_params, read, names, *, head_scale: float = 1.0
                   ) -> dict:
  """{our param path: numpy array in cfg.param_dtype}, checking shapes and leftovers.

  An untied unembedding reads lm_head.weight, or `shared` when the file has none;
  `head_scale` is multiplied into it (a T5 that scales its output but has its own head).
  """
  table, out = name_table(cfg), {}
  tensors = TensorReader(read, list(names), what="T5 checkpoint")
  np_dtype = np.dtype(cfg.jnp_param_dtype)
  for path, var in nnx.to_flat_state(abstract_params):
    template, n_in = table[path]
    if path == ("unembed_DV",) and template not in tensors:
      template = "shared.weight"  # transformers 5 saves no lm_head when it equals `shared`
    arr = tensors.stacked(template, tuple(var.get_value().shape), n_in, np_dtype)
    if path == ("unembed_DV",) and head_scale != 1.0:
      arr *= np.asarray(head_scale, np_dtype)
    out[path] = arr
  # Aliases of `shared` (older exports save them), and a cross-attention bias T5 never uses.
  ignorable = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight",
               "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}
  unexpected = tensors.unused(ignorable)
  if unexpected:
    raise ValueError(f"T5 checkpoint has {len(unexpected)} tensor(s) this model does not use, "
                     f"e.g. {unexpected[:5]}; refusing to drop them silently")
  return out


def _separate_head(tensors: SafetensorsDir) -> bool:
  """Whether lm_head.weight exists and differs from `shared` (aliases must equal `shared`)."""
  names = set(tensors.names)
  if "shared.weight" not in names:
    raise ValueError("T5 checkpoint is missing tensor 'shared.weight'")
  shared = tensors.read("shared.weight")
  for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
    if alias in names and not np.array_equal(tensors.read(alias), shared):
      raise ValueError(f"checkpoint tensor {alias!r} differs from 'shared.weight'; T5 uses one "
                       "embedding table for encoder and decoder")
  return "lm_head.weight" in names and not np.array_equal(tensors.read("lm_head.weight"), shared)


def load(directory: str, mesh=None, dtype: str | None = None, param_dtype: str | None = None
         ) -> tuple[EncoderDecoder, Tokenizer | None]:
  """(EncoderDecoder, Tokenizer or None) from a T5ForConditionalGeneration directory.

  With `mesh`, each array is placed straight into its sharding (logical axis names).

  dtype (compute) / param_dtype (storage) override the checkpoint's stored dtype.
  The tokenizer is None when the directory has no tokenizer.json.
  """
  directory = os.fspath(directory)
  hf = read_config(directory)
  source = os.path.join(directory, CONFIG_FILE)
  tensors = SafetensorsDir(directory)
  separate = _separate_head(tensors)
  cfg = config_from_hf(hf, source, separate_head=separate, dtype=dtype, param_dtype=param_dtype)
  scale = cfg.d_model ** -0.5 if scales_output(hf) and not cfg.tie_embeddings else 1.0
  model = build_from_params(cfg, lambda state: params_from_hf(
      cfg, state, tensors.read, tensors.names, head_scale=scale), mesh)
  tokenizer = None
  if os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
    tokenizer = Tokenizer.load(directory)
  else:
    warnings.warn(f"{directory} has no {TOKENIZER_FILE}; returning tokenizer=None")
  return model, tokenizer
