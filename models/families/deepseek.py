"""DeepSeek-V3 (DeepseekV3ForCausalLM) and DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM):
multi-head latent attention (models/mla.py) and a mixture of routed plus shared experts after
`first_k_dense_replace` dense blocks.

V3 routes by each expert's sigmoid score, chosen with the balancing bias
(e_score_correction_bias: model.router_bias_rate moves it in training) within the best
`topk_group` of `n_group` groups, the chosen scores renormalised; V2 by a softmax, greedy or
group-limited, unnormalised. Both scale the routed output by routed_scaling_factor. The
rotary features are interleaved pairs. YaRN's `mscale_all_dim` scales the softmax by its
mscale squared, as transformers' yarn_apply_mscale does.
"""

import math

from models import rope as rope_lib
from models.families import base

_SHARED = {
    ("mlp", "shared", "gate_DF"): ("mlp.shared_experts.gate_proj.weight", 1),
    ("mlp", "shared", "up_DF"): ("mlp.shared_experts.up_proj.weight", 1),
    ("mlp", "shared", "down_FD"): ("mlp.shared_experts.down_proj.weight", 1),
}
_LATENT = {
    ("attn", "wkv_a_DC"): ("self_attn.kv_a_proj.weight", 1),       # rows of kv_a_proj_with_mqa
    ("attn", "wkr_DR"): ("self_attn.kv_a_proj_rope.weight", 1),    # its last rope rows
    ("attn", "kv_norm", "scale"): ("self_attn.kv_a_layernorm.weight", 0),
    ("attn", "wk_b_CNH"): ("self_attn.kv_b_proj_k.weight", 1),     # each head's rows of kv_b_proj
    ("attn", "wv_b_CNU"): ("self_attn.kv_b_proj_v.weight", 1),
    ("attn", "wo_NUD"): ("self_attn.o_proj.weight", 2),
}
_Q_LORA = {
    ("attn", "wq_a_DQ"): ("self_attn.q_a_proj.weight", 1),
    ("attn", "q_norm", "scale"): ("self_attn.q_a_layernorm.weight", 0),
    ("attn", "wq_b_QNX"): ("self_attn.q_b_proj.weight", 1),
}
_Q = {("attn", "wq_DNX"): ("self_attn.q_proj.weight", 1)}
_BIAS = {("mlp", "router_bias_E"): ("mlp.gate.e_score_correction_bias", 0)}
# DeepSeek-V3's bias update speed (its paper's gamma) for models loaded with the bias.
BIAS_RATE = 0.001


def _layer_names(cfg) -> dict:
  names = {**base.NORMS, **_LATENT, **(_Q_LORA if cfg.q_lora_rank else _Q)}
  if not cfg.is_moe:  # the first_k_dense_replace blocks (cfg.dense_config)
    return {**names, **base.DENSE_MLP}
  return {**names, **base.EXPERTS, **_SHARED, **(_BIAS if cfg.router_bias_rate else {})}


def _fused(cfg) -> dict:
  return {
      "self_attn.kv_a_proj_with_mqa.weight": [("self_attn.kv_a_proj.weight", cfg.kv_lora_rank),
                                              ("self_attn.kv_a_proj_rope.weight",
                                               cfg.rope_head_dim)],
      # per head: its key rows, then its value rows
      "self_attn.kv_b_proj.weight": base.PerHead(cfg.num_heads, [
          ("self_attn.kv_b_proj_k.weight", cfg.head_dim),
          ("self_attn.kv_b_proj_v.weight", cfg.value_dim)]),
  }


def _normalize(hf: dict, source: str) -> dict:
  """YaRN's mscale / mscale_all_dim as the attention factor and softmax scale they make."""
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  m, m_all = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
  if m is None and m_all is None:
    return hf
  if rope.get("rope_type", rope.get("type")) != "yarn":
    raise ValueError(f"{source}: mscale / mscale_all_dim are YaRN parameters; rope type "
                     f"{rope.get('rope_type', rope.get('type'))!r}")
  factor = rope.get("factor") or (hf["max_position_embeddings"]
                                  / rope["original_max_position_embeddings"])
  if rope.get("attention_factor") is None and m and m_all:
    mscale = rope_lib.yarn_mscale
    rope["attention_factor"] = mscale(factor, m) / mscale(factor, m_all)
  out = {**hf, "rope_parameters": rope, "rope_scaling": None}
  if m_all:
    head = hf.get("qk_nope_head_dim", 128) + hf.get("qk_rope_head_dim", 64)
    out["_attention_scale"] = head ** -0.5 * rope_lib.yarn_mscale(factor, m_all) ** 2
  return out


def _common(hf, get, source) -> dict:
  """The latent attention, shared experts and dense blocks both versions have."""
  base.refuse_keys(hf, source)
  base.check_activation(hf, source)
  base.no_window(hf, source)
  shared = get("n_shared_experts") or 0
  if shared < 1:
    raise ValueError(f"{source}: n_shared_experts={shared!r}; DeepSeek's blocks have at least "
                     "one shared expert")
  if not get("n_routed_experts"):
    raise ValueError(f"{source}: n_routed_experts={get('n_routed_experts')!r}: a DeepSeek "
                     "without routed experts is not supported")
  heads = hf["num_attention_heads"]
  if (get("num_key_value_heads") or heads) != heads:
    raise ValueError(f"{source}: num_key_value_heads={hf['num_key_value_heads']} != "
                     f"num_attention_heads={heads}: latent attention has no key/value groups")
  moe_dim = get("moe_intermediate_size")
  return dict(
      head_dim=get("qk_nope_head_dim"), rope_head_dim=get("qk_rope_head_dim"),
      v_head_dim=get("v_head_dim"), kv_lora_rank=get("kv_lora_rank"),
      q_lora_rank=get("q_lora_rank") or 0, num_kv_heads=heads,
      attention_scale=hf.get("_attention_scale", 0.0),
      num_experts=get("n_routed_experts"), top_k=get("num_experts_per_tok"), mlp_dim=moe_dim,
      dense_mlp_dim=hf["intermediate_size"], shared_mlp_dim=moe_dim * shared,
      first_dense_layers=get("first_k_dense_replace") or 0,
      routed_scale=float(get("routed_scaling_factor")), moe_impl="dropless")


def _v3_values(hf, get, source):
  groups, best = get("n_group") or 1, get("topk_group") or 1
  if not get("rope_interleave"):
    raise ValueError(f"{source}: rope_interleave=false is not supported (the rotary features "
                     "are interleaved pairs)")
  # The loss-free balancing bias replaces most of the auxiliary loss (the paper's
  # sequence-wise one has weight 1e-4).
  return {**_common(hf, get, source), "router_score": "sigmoid",
          "router_norm": "topk" if get("norm_topk_prob") else "all",
          "router_groups": groups if groups > 1 else 0,
          "router_group_topk": best if groups > 1 else 0, "router_bias_rate": BIAS_RATE,
          "aux_loss_weight": 1e-4, "rope_interleaved": True}


def _v2_values(hf, get, source):
  method = get("topk_method")
  if method not in ("greedy", "group_limited_greedy"):
    raise ValueError(f"{source}: topk_method={method!r}; only greedy and group_limited_greedy")
  if get("norm_topk_prob"):
    raise ValueError(f"{source}: norm_topk_prob=true: transformers' DeepSeek-V2 router does not "
                     "renormalise, so meshlm would not match it")
  grouped = method == "group_limited_greedy"
  return {**_common(hf, get, source), "router_score": "softmax", "router_norm": "all",
          "router_groups": get("n_group") if grouped else 0,
          "router_group_topk": get("topk_group") if grouped else 0,
          "aux_loss_weight": float(get("aux_loss_alpha") or 0.001), "rope_interleaved": True}


def _mscale_back(cfg, hf) -> dict:
  """hf with rope_parameters' mscale_all_dim, recovered from model.attention_scale (the
  softmax scale times YaRN's mscale squared, `_normalize`)."""
  if not cfg.attention_scale:
    return hf
  plain = (cfg.head_dim + cfg.rope_head_dim) ** -0.5
  if cfg.rope_scaling != "yarn" or not cfg.rope_factor > 1 or cfg.attention_scale < plain:
    raise ValueError(f"cannot export as DeepSeek: model.attention_scale={cfg.attention_scale} "
                     "is expressed only as YaRN's mscale_all_dim (factor > 1, scale >= "
                     f"(head_dim + rope_head_dim)^-0.5 = {plain})")
  m_all = (math.sqrt(cfg.attention_scale / plain) - 1) / (0.1 * math.log(cfg.rope_factor))
  # mscale_all_dim alone: transformers derives the cos/sin factor as we do (0.1 ln(factor) + 1)
  # unless rope_parameters carries attention_factor, which to_hf writes where we have one
  return {**hf, "rope_parameters": {**hf["rope_parameters"], "mscale_all_dim": m_all}}


def _hf(cfg, hf) -> dict:
  base.fixed(cfg, "DeepSeek", {"rope_interleaved": (True, "its rotary features are pairs"),
                               "shared_gate": (False, "its shared experts are ungated")})
  hf = _mscale_back(cfg, hf)
  if not cfg.shared_mlp_dim or cfg.shared_mlp_dim % cfg.mlp_dim:
    raise ValueError(f"cannot export as DeepSeek: model.shared_mlp_dim={cfg.shared_mlp_dim} is "
                     f"not a positive multiple of the expert width {cfg.mlp_dim}")
  return {**hf, "intermediate_size": cfg.dense_config.mlp_dim,
          "moe_intermediate_size": cfg.mlp_dim, "n_routed_experts": cfg.num_experts,
          "n_shared_experts": cfg.shared_mlp_dim // cfg.mlp_dim,
          "num_experts_per_tok": cfg.top_k, "first_k_dense_replace": cfg.first_dense_layers,
          "routed_scaling_factor": cfg.routed_scale, "kv_lora_rank": cfg.kv_lora_rank,
          "q_lora_rank": cfg.q_lora_rank or None, "qk_rope_head_dim": cfg.rope_head_dim,
          "qk_nope_head_dim": cfg.head_dim, "v_head_dim": cfg.value_dim,
          "head_dim": cfg.rope_head_dim, "attention_bias": False}


def _v3_hf(cfg, hf):
  if not cfg.router_bias_rate:
    raise ValueError("cannot export as DeepSeek-V3: model.router_bias_rate=0 (its router always "
                     "has the balancing bias)")
  groups = cfg.router_groups or 1
  return {**_hf(cfg, hf), "n_group": groups, "topk_group": cfg.router_group_topk or 1,
          "norm_topk_prob": cfg.router_norm == "topk", "rope_interleave": True}


def _v2_hf(cfg, hf):
  base.fixed(cfg, "DeepSeek-V2", {
      "router_norm": ("all", "its router does not renormalise"),
      "router_bias_rate": (0.0, "its router has no balancing bias")})
  grouped = bool(cfg.router_groups)
  return {**_hf(cfg, hf), "topk_method": "group_limited_greedy" if grouped else "greedy",
          "n_group": cfg.router_groups or None, "topk_group": cfg.router_group_topk or None,
          "norm_topk_prob": False, "aux_loss_alpha": cfg.aux_loss_weight}


def _claims(score):
  return lambda cfg: cfg.mla and cfg.is_moe and cfg.router_score == score and cfg.llama_shaped


_DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0,
                 n_shared_experts=1, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 kv_lora_rank=512, routed_scaling_factor=1.0, first_k_dense_replace=0)

DEEPSEEK_V3 = base.register(base.Family(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
    defaults={**_DEFAULTS, "q_lora_rank": 1536, "n_group": 8, "topk_group": 4,
              "num_experts_per_tok": 8, "n_routed_experts": 256, "moe_intermediate_size": 2048,
              "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "norm_topk_prob": True,
              "rope_interleave": True},
    values=_v3_values, claims=_claims("sigmoid"), to_hf=_v3_hf, layer_names=_layer_names,
    normalize=_normalize, fused=_fused))

DEEPSEEK_V2 = base.register(base.Family(
    model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM",
    defaults={**_DEFAULTS, "max_position_embeddings": 2048, "q_lora_rank": 1536,
              "n_routed_experts": 64, "n_shared_experts": 2,
              "moe_intermediate_size": 1407, "topk_method": "greedy", "norm_topk_prob": False},
    values=_v2_values, claims=_claims("softmax"), to_hf=_v2_hf, layer_names=_layer_names,
    normalize=_normalize, fused=_fused))
