"""Qwen2-MoE (Qwen2MoeForCausalLM, Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with every
MLP a mixture of routed SwiGLU experts plus a shared expert every token goes through, its
output scaled by its own sigmoid gate (model.shared_gate)."""

from models.families import base

_SHARED = {
    ("mlp", "shared", "gate_DF"): ("mlp.shared_expert.gate_proj.weight", 1),
    ("mlp", "shared", "up_DF"): ("mlp.shared_expert.up_proj.weight", 1),
    ("mlp", "shared", "down_FD"): ("mlp.shared_expert.down_proj.weight", 1),
    ("mlp", "shared_gate_D1"): ("mlp.shared_expert_gate.weight", 1),
}


def _values(hf, get, source):
  base.llama_checks(hf, source, base.unused_window)
  if hf.get("qkv_bias", True) is not True:
    raise ValueError(f"{source}: qkv_bias={hf['qkv_bias']!r} is not supported; only true")
  shared = get("shared_expert_intermediate_size")
  return {**base.moe_values(hf, get, source, "moe_intermediate_size"), "qkv_bias": True,
          "shared_mlp_dim": shared, "shared_gate": bool(shared)}


def _to_hf(cfg, hf):
  rules = {"shared_gate": (bool(cfg.shared_mlp_dim), "Qwen2-MoE gates its shared expert")}
  return {**base.moe_hf(cfg, hf, "Qwen2MoeForCausalLM", "moe_intermediate_size", rules),
          "intermediate_size": cfg.mlp_dim, "shared_expert_intermediate_size": cfg.shared_mlp_dim,
          "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
          "max_window_layers": cfg.num_layers}


QWEN2_MOE = base.register(base.Family(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                  moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                  norm_topk_prob=False, router_aux_loss_coef=0.001, decoder_sparse_step=1),
    values=_values,
    claims=lambda cfg: base.routed(cfg) and cfg.qkv_bias and not cfg.qk_norm,
    to_hf=_to_hf,
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.EXPERTS, **base.QKV_BIAS,
                             **(_SHARED if cfg.shared_mlp_dim else {})}))
