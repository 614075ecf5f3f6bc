"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k norms) with every MLP a
mixture of routed SwiGLU experts, the chosen k's softmax weights renormalised where
norm_topk_prob (Qwen3-30B-A3B), kept as they are otherwise."""

from models.families import base


def _values(hf, get, source):
  base.llama_checks(hf, source, base.unused_window)
  return {**base.moe_values(hf, get, source, "moe_intermediate_size"), "qk_norm": True}


def _to_hf(cfg, hf):
  rules = {"shared_mlp_dim": (0, "Qwen3-MoE has no shared expert")}
  return {**base.moe_hf(cfg, hf, "Qwen3MoeForCausalLM", "moe_intermediate_size", rules),
          "intermediate_size": cfg.mlp_dim, "use_sliding_window": False, "sliding_window": None,
          "max_window_layers": cfg.num_layers, "attention_bias": False}


QWEN3_MOE = base.register(base.Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, norm_topk_prob=False, router_aux_loss_coef=0.001,
                  decoder_sparse_step=1),
    values=_values,
    claims=lambda cfg: base.routed(cfg) and cfg.qk_norm and not cfg.qkv_bias,
    to_hf=_to_hf,
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.EXPERTS, **base.QK_NORM}))
