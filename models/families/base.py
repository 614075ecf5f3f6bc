"""What every decoder family shares: the `Family` record the registry holds, the Llama-shaped
config.json keys and tensor names most families start from, and the checks they share.

A family file (models/families/*.py) builds one `Family` from these parts and registers it;
models/families/__init__.py dispatches on model_type (import) and on `Family.claims`
(export), so a new family changes no other family's mapping.
"""

import dataclasses
from typing import Callable

from models import rope as rope_lib
from models.config import ModelConfig

FLAT = -1  # layout code: a 1-D checkpoint tensor reshaped to our (multi-axis) shape

# Our param path -> (Hugging Face name, number of leading "input" axes in our layout).
# 0 means the tensor is copied as is; n > 0 means HF [out, in] <-> ours [in..., out...].
# In per-layer names "{0}" is the layer index and "{1}" the expert index: each "{}" is
# one leading stacked axis of our param ([L, ...] or [L, E, ...]) that HF stores as
# separate tensors.
GLOBAL = {
    ("embed_VD",): ("model.embed_tokens.weight", 0),
    ("final_norm", "scale"): ("model.norm.weight", 0),
    ("unembed_DV",): ("lm_head.weight", 1),
}
ATTENTION = {
    ("attn", "wq_DNH"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk_DKH"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv_DKH"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo_NHD"): ("self_attn.o_proj.weight", 2),
}
NORMS = {
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", 0),
}
DENSE_MLP = {
    ("mlp", "gate_DF"): ("mlp.gate_proj.weight", 1),
    ("mlp", "up_DF"): ("mlp.up_proj.weight", 1),
    ("mlp", "down_FD"): ("mlp.down_proj.weight", 1),
}
# Biases on the query, key and value projections (model.qkv_bias: Qwen2, Qwen2-MoE).
QKV_BIAS = {
    ("attn", "bq_NH"): ("self_attn.q_proj.bias", FLAT),
    ("attn", "bk_KH"): ("self_attn.k_proj.bias", FLAT),
    ("attn", "bv_KH"): ("self_attn.v_proj.bias", FLAT),
}
# An RMSNorm over each head's query and key (model.qk_norm: Qwen3, Qwen3-MoE, Gemma 3).
QK_NORM = {
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", 0),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", 0),
}
# Routed experts as Qwen-MoE and OLMoE name them (Mixtral: models/families/mixtral.py).
EXPERTS = {
    ("mlp", "router_DE"): ("mlp.gate.weight", 1),
    ("mlp", "gate_EDF"): ("mlp.experts.{1}.gate_proj.weight", 1),
    ("mlp", "up_EDF"): ("mlp.experts.{1}.up_proj.weight", 1),
    ("mlp", "down_EFD"): ("mlp.experts.{1}.down_proj.weight", 1),
}
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face decoder family: its config.json mapping and tensor names.

  values(hf, get, source) -> ModelConfig values beyond `common_values` (get(key) reads
      config.json, falling back on `defaults`); raises ValueError for what it cannot run.
  claims(cfg) -> whether a ModelConfig exports as this family (exactly one family may).
  to_hf(cfg, hf) -> config.json: `common_hf`'s keys `hf` plus the family's own.
  layer_names(cfg) -> {our per-layer param path: (HF name after "model.layers.{0}.", n_in)}.
  """
  model_type: str
  architecture: str
  defaults: dict
  values: Callable[[dict, Callable, str], dict]
  claims: Callable[[ModelConfig], bool]
  to_hf: Callable[[ModelConfig, dict], dict]
  layer_names: Callable[[ModelConfig], dict]
  global_names: dict = dataclasses.field(default_factory=lambda: dict(GLOBAL))
  # config.json in the shape `common_values` reads (e.g. Gemma 3's per-layer-type rope); None:
  # read as written.
  normalize: Callable[[dict, str], dict] | None = None
  # Tensors the family stores fused along their output rows (Phi-3's qkv_proj, gate_up_proj):
  # fused(cfg) -> {fused name after "model.layers.{0}.": [(part name, rows), ...]}, the parts
  # being names in layer_names, in order; or PerHead(n, parts): the parts' rows repeat per
  # head (DeepSeek's kv_b_proj: each head's key rows, then its value rows).
  fused: Callable[[ModelConfig], dict] | None = None


@dataclasses.dataclass(frozen=True)
class PerHead:
  """A fused tensor whose rows are `heads` groups, each holding every part's rows in order."""
  heads: int
  parts: list


REGISTRY: dict[str, Family] = {}  # model_type -> Family, in registration order


def register(family: Family) -> Family:
  if family.model_type in REGISTRY:
    raise ValueError(f"decoder family {family.model_type!r} is registered twice")
  REGISTRY[family.model_type] = family
  return family


def first(value):
  return value[0] if isinstance(value, (list, tuple)) else value


def refuse_keys(hf: dict, source: str, keys=("attention_bias", "mlp_bias")) -> None:
  """Rejects config.json flags this decoder does not model (true-valued `keys`)."""
  for key in keys:
    if hf.get(key):
      raise ValueError(f"{source}: {key}=true is not supported (the decoder has no such "
                       "mechanism)")


def check_activation(hf: dict, source: str, allowed=("silu",), key: str = "hidden_act") -> str:
  act = hf.get(key, allowed[0])
  if act not in allowed:
    raise ValueError(f"{source}: {key}={act!r} is not supported; only {list(allowed)}")
  return act


def unused_window(hf: dict, source: str) -> None:
  """Qwen2/Qwen3 write a sliding_window they do not use unless use_sliding_window is set."""
  if hf.get("use_sliding_window", False):
    raise ValueError(f"{source}: use_sliding_window=true (Qwen's per-layer windows, "
                     f"max_window_layers={hf.get('max_window_layers')!r}) is not supported")


def no_window(hf: dict, source: str) -> None:
  if hf.get("sliding_window") is not None:
    raise ValueError(f"{source}: sliding_window={hf['sliding_window']!r} is not supported (the "
                     "family has no sliding-window attention); only null")


def llama_checks(hf: dict, source: str, window: Callable = no_window) -> None:
  """The checks of a Llama-shaped family: no biases, SiLU, and its own `window` check."""
  refuse_keys(hf, source)
  check_activation(hf, source)
  window(hf, source)


def common_values(hf: dict, get: Callable, source: str) -> dict:
  """ModelConfig values of the keys every Llama-shaped config.json has."""
  # transformers 4 writes rope_theta/rope_scaling; 5 writes rope_parameters.
  rope = hf.get("rope_parameters") or {}
  scaling = rope_lib.from_hf(rope_lib.merge_hf(rope, hf.get("rope_scaling") or {}, source),
                             source, get("max_position_embeddings"))
  heads = hf["num_attention_heads"]
  dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
  dtype = dtype if dtype in _DTYPES else "float32"
  return dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
      head_dim=get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
      norm_eps=float(get("rms_norm_eps")),
      tie_embeddings=bool(get("tie_word_embeddings") or False),
      # dynamic NTK stretches past max_position_embeddings (its threshold) by `factor`
      max_seq_len=(int(get("max_position_embeddings") * scaling["rope_factor"])
                   if scaling["rope_scaling"] == "dynamic" else get("max_position_embeddings")),
      param_dtype=dtype, dtype=dtype,
      bos_id=first(hf.get("bos_token_id")), eos_id=first(hf.get("eos_token_id")), **scaling)


def common_hf(cfg: ModelConfig, family: Family) -> dict:
  """The config.json keys every Llama-shaped family writes (transformers 4 and 5 read them)."""
  return {
      "architectures": [family.architecture], "model_type": family.model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": rope_lib.to_hf(cfg.rope, cfg.rope_theta),
      "max_position_embeddings": (cfg.rope_original_max_len if cfg.rope_scaling == "dynamic"
                                  else cfg.max_seq_len),
      "tie_word_embeddings": cfg.tie_embeddings,
      "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "dtype": cfg.param_dtype,
  }


def dense_llama(cfg: ModelConfig) -> bool:
  """Exactly Llama's block (what the dense Llama-shaped families add to)."""
  return (cfg.plain_llama and not cfg.is_moe and not cfg.qk_norm_full and not cfg.shared_gate
          and not cfg.mla)


def fixed(cfg: ModelConfig, family: str, rules: dict) -> None:
  """Refuses an export that would drop a ModelConfig field: rules {field: (the only value the
  family expresses, why)}."""
  for field, (allowed, why) in rules.items():
    if getattr(cfg, field) != allowed:
      raise ValueError(f"cannot export as {family}: model.{field}={getattr(cfg, field)!r} "
                       f"({why}; only {allowed!r} can be exported)")


def moe_values(hf: dict, get: Callable, source: str, ffn_key: str) -> dict:
  """The routed experts of a Qwen-MoE/OLMoE config.json: every layer sparse, the softmax over
  all experts renormalised over the chosen k where norm_topk_prob."""
  step, dense = get("decoder_sparse_step") or 1, get("mlp_only_layers") or []
  if step != 1 or dense:
    raise ValueError(f"{source}: decoder_sparse_step={step}, mlp_only_layers={dense}: dense "
                     "layers among the sparse ones are not supported (every layer has experts)")
  # HF's load-balancing loss is k at uniform load, ours 1, so its coefficient times k
  # gives the same gradient.
  k = get("num_experts_per_tok")
  # transformers 5 writes Qwen3-MoE's count as num_local_experts, the Hub as num_experts.
  experts = hf.get("num_experts", hf.get("num_local_experts")) or get("num_experts")
  return dict(num_experts=experts, top_k=k, mlp_dim=get(ffn_key),
              router_norm="topk" if get("norm_topk_prob") else "all", moe_impl="dropless",
              aux_loss_weight=float(get("router_aux_loss_coef")) * k)


def moe_hf(cfg: ModelConfig, hf: dict, family: str, ffn_key: str, rules: dict) -> dict:
  """The routed experts' config.json keys (the inverse of moe_values); `rules` as `fixed`."""
  fixed(cfg, family, {"router_bias_rate": (0.0, "the router has no expert-selection bias"),
                      **rules})
  return {**hf, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
          ffn_key: cfg.mlp_dim, "norm_topk_prob": cfg.router_norm == "topk",
          "router_aux_loss_coef": cfg.aux_loss_weight / cfg.top_k, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "output_router_logits": False}


def routed(cfg: ModelConfig) -> bool:
  """A Llama-shaped decoder with routed experts, no sliding window (none of these families
  writes a window transformers would run) and none of DeepSeek's mechanisms (latent
  attention, dense first blocks, sigmoid or grouped routing, routed scaling): what the
  Qwen-MoE, OLMoE and Mixtral families add to."""
  return (cfg.plain_llama and cfg.is_moe and not cfg.sliding_window and not cfg.mla
          and not cfg.first_dense_layers and cfg.router_score == "softmax"
          and not cfg.router_groups and cfg.routed_scale == 1.0)
