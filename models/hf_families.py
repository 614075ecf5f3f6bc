"""The decoder families loaded from and exported to Hugging Face directories: each one's
config.json mapping (`config_from_hf`, `config_to_hf`) and tensor names (`name_table`).
models/hf_io.py reads and writes the tensors by these names.

  llama    LlamaForCausalLM: RoPE (with Llama 3.x's and other context-extension schemes,
           models/rope.py), no biases
  qwen2    Qwen2ForCausalLM: Llama plus biases on the q/k/v projections
  qwen3    Qwen3ForCausalLM: Llama plus an RMSNorm over each head's query and key
  mistral  MistralForCausalLM: Llama with sliding-window attention (every layer, one window)
  mixtral  MixtralForCausalLM: Llama with a top-k routed mixture of experts
"""

from models import rope as rope_lib
from models.config import ModelConfig

FLAT = -1  # layout code: a 1-D checkpoint tensor reshaped to our (multi-axis) shape

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
# Qwen2's biases on the query, key and value projections (model.qkv_bias).
_QKV_BIAS = {
    ("attn", "bq_NH"): ("self_attn.q_proj.bias", FLAT),
    ("attn", "bk_KH"): ("self_attn.k_proj.bias", FLAT),
    ("attn", "bv_KH"): ("self_attn.v_proj.bias", FLAT),
}
# Qwen3's RMSNorm over each head's query and key (model.qk_norm).
_QK_NORM = {
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", 0),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", 0),
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
    "qwen2": ("Qwen2ForCausalLM", dict(rope_theta=10000.0, rms_norm_eps=1e-6,
                                       max_position_embeddings=32768, num_key_value_heads=32)),
    "qwen3": ("Qwen3ForCausalLM", dict(rope_theta=10000.0, rms_norm_eps=1e-6,
                                       max_position_embeddings=32768, num_key_value_heads=32,
                                       head_dim=128)),
    "mistral": ("MistralForCausalLM", dict(rope_theta=10000.0, rms_norm_eps=1e-6,
                                           max_position_embeddings=131072,
                                           num_key_value_heads=8, sliding_window=4096)),
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
  """ModelConfig from a Llama, Qwen2, Qwen3, Mistral or Mixtral config.json; what we cannot
  run exactly is rejected."""
  arch, model_type = hf.get("architectures") or [], hf.get("model_type")
  if model_type not in _ARCHS or any(a != _ARCHS[model_type][0] for a in arch):
    raise ValueError(f"unsupported architecture {arch or model_type!r} (model_type={model_type!r})"
                     f" in {source}; only LlamaForCausalLM (model_type 'llama'), "
                     "Qwen2ForCausalLM ('qwen2'), Qwen3ForCausalLM ('qwen3'), "
                     "MistralForCausalLM ('mistral'), "
                     "MixtralForCausalLM ('mixtral'), BERT "
                     "encoders ('bert', models/hf_bert.py) "
                     "and T5ForConditionalGeneration ('t5', models/hf_t5.py) are supported")
  defaults = _ARCHS[model_type][1]

  def get(key):
    return hf.get(key, defaults.get(key))

  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):  # Llama's and Qwen3's put one on the output projection too
      raise ValueError(f"{source}: {key}=true is not supported (the decoder has no biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
  # Qwen2 and Qwen3 write a window they do not use unless use_sliding_window is set.
  unused_window = model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False)
  window = get("sliding_window") if model_type == "mistral" else None
  if model_type != "mistral" and hf.get("sliding_window") is not None and not unused_window:
    raise ValueError(f"{source}: sliding_window={hf['sliding_window']!r} is not supported (the "
                     "decoder has no sliding-window attention); only null")
  # transformers 4 writes rope_theta/rope_scaling; 5 writes rope_parameters.
  rope = hf.get("rope_parameters") or {}
  scaling = rope_lib.from_hf(rope_lib.merge_hf(rope, hf.get("rope_scaling") or {}, source),
                             source, get("max_position_embeddings"))
  heads = hf["num_attention_heads"]
  dtype = _DTYPE_NAMES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), "float32")
  values = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
      head_dim=get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
      norm_eps=float(get("rms_norm_eps")),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=get("max_position_embeddings"),
      param_dtype=dtype, dtype=dtype,
      bos_id=_first(hf.get("bos_token_id")), eos_id=_first(hf.get("eos_token_id")), **scaling)
  if model_type == "qwen2":
    values["qkv_bias"] = True
  if model_type == "qwen3":
    values["qk_norm"] = True
  if window:
    values["sliding_window"] = int(window)
  if model_type == "mixtral":
    # HF's load-balancing loss is k at uniform load, ours 1, so its coefficient times k
    # gives the same gradient. router_jitter_noise only perturbs HF training: ignored.
    k = get("num_experts_per_tok")
    values.update(num_experts=get("num_local_experts"), top_k=k, router_norm="topk",
                  moe_impl="dropless", aux_loss_weight=float(get("router_aux_loss_coef")) * k)
  values.update({key: v for key, v in overrides.items() if v is not None})
  return ModelConfig(**values)


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json for LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM
  (per-head q/k norms), MistralForCausalLM (a sliding window), or MixtralForCausalLM
  for an MoE config.

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
  if cfg.sliding_window and (cfg.is_moe or cfg.qkv_bias or cfg.qk_norm):
    # Written as is, transformers would run full attention: refuse instead of changing the model.
    raise ValueError(f"model.sliding_window={cfg.sliding_window!r} cannot be exported with "
                     "experts, q/k/v biases or q/k norms: only as MistralForCausalLM")
  arch = ("mixtral" if cfg.is_moe else "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias
          else "mistral" if cfg.sliding_window else "llama")
  if cfg.is_moe and (cfg.qkv_bias or cfg.qk_norm) or cfg.qkv_bias and cfg.qk_norm:
    raise ValueError(f"no Hugging Face family here has qkv_bias={cfg.qkv_bias}, "
                     f"qk_norm={cfg.qk_norm} and num_experts={cfg.num_experts}: cannot export")
  hf = {
      "architectures": [_ARCHS[arch][0]], "model_type": arch,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": rope_lib.to_hf(cfg.rope, cfg.rope_theta),
      "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
      "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "dtype": cfg.param_dtype,
  }
  if arch == "mistral":
    return {**hf, "sliding_window": cfg.sliding_window}
  if arch in ("qwen2", "qwen3"):
    return {**hf, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers,
            **({"attention_bias": False} if arch == "qwen3" else {})}
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
  layer = {**_LAYER, **(_MOE_MLP if cfg.is_moe else _DENSE_MLP),
           **(_QKV_BIAS if cfg.qkv_bias else {}), **(_QK_NORM if cfg.qk_norm else {})}
  return {**_GLOBAL,
          **{("blocks", *path): ("model.layers.{0}." + name, n_in)
             for path, (name, n_in) in layer.items()}}


def lookup_name(table: dict, path: tuple) -> tuple[str, int]:
  """(HF name template, n_in) of param `path` in a `name_table`; ValueError if it has none."""
  if path not in table:  # e.g. MoE extras that config_to_hf rejects first
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no Hugging Face equivalent")
  return table[path]


