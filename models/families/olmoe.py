"""OLMoE (OlmoeForCausalLM): Llama with one RMSNorm across all heads' query (and key)
features, before RoPE (model.qk_norm_full), and every MLP a mixture of routed SwiGLU experts
(the softmax over all experts, the chosen k's weights renormalised only where norm_topk_prob)."""

from models.families import base

# One scale per query (key) feature, all heads together: stored [N·H], ours [N, H].
_QK_NORM_FULL = {
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", base.FLAT),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", base.FLAT),
}


def _values(hf, get, source):
  base.llama_checks(hf, source)
  if hf.get("clip_qkv") is not None:
    raise ValueError(f"{source}: clip_qkv={hf['clip_qkv']!r} is not supported; only null")
  return {**base.moe_values(hf, get, source, "intermediate_size"), "qk_norm_full": True}


def _to_hf(cfg, hf):
  rules = {"shared_mlp_dim": (0, "OLMoE has no shared expert")}
  out = base.moe_hf(cfg, hf, "OlmoeForCausalLM", "intermediate_size", rules)
  del out["decoder_sparse_step"], out["mlp_only_layers"]  # OLMoE's experts are on every layer
  return {**out, "clip_qkv": None, "attention_bias": False}


OLMOE = base.register(base.Family(
    model_type="olmoe", architecture="OlmoeForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                  num_key_value_heads=None, num_experts=64, num_experts_per_tok=8,
                  norm_topk_prob=False, router_aux_loss_coef=0.01),
    values=_values,
    claims=lambda cfg: base.routed(cfg) and cfg.qk_norm_full and not cfg.qkv_bias,
    to_hf=_to_hf,
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.EXPERTS, **_QK_NORM_FULL}))
