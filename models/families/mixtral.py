"""Mixtral (MixtralForCausalLM): Llama whose MLP is a top-k routed mixture of SwiGLU experts,
the softmax renormalised over the chosen k. Read in the layout the Hub publishes (and
transformers 5 still saves by default) and in transformers 5's fused in-memory layout
(models/hf_io.py unfuses it)."""

from models.families import base

_MOE_MLP = {
    ("mlp", "router_DE"): ("block_sparse_moe.gate.weight", 1),
    ("mlp", "gate_EDF"): ("block_sparse_moe.experts.{1}.w1.weight", 1),
    ("mlp", "up_EDF"): ("block_sparse_moe.experts.{1}.w3.weight", 1),
    ("mlp", "down_EFD"): ("block_sparse_moe.experts.{1}.w2.weight", 1),
}
# ModelConfig fields HF Mixtral cannot express, with the only value export accepts.
_FIXED = {
    "shared_mlp_dim": (0, "Mixtral has no shared expert"),
    "router_bias_rate": (0.0, "Mixtral's router has no expert-selection bias"),
    "router_norm": ("topk", "Mixtral renormalises the softmax over the chosen experts"),
}


def _values(hf, get, source):
  base.llama_checks(hf, source)
  # HF's load-balancing loss is k at uniform load, ours 1, so its coefficient times k
  # gives the same gradient. router_jitter_noise only perturbs HF training: ignored.
  k = get("num_experts_per_tok")
  return dict(num_experts=get("num_local_experts"), top_k=k, router_norm="topk",
              moe_impl="dropless", aux_loss_weight=float(get("router_aux_loss_coef")) * k)


def _to_hf(cfg, hf):
  """moe_impl="capacity" exports the same weights, which transformers then runs dropless."""
  base.fixed(cfg, "MixtralForCausalLM", _FIXED)
  return {**hf, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
          "router_aux_loss_coef": cfg.aux_loss_weight / cfg.top_k,  # see _values
          "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False}


MIXTRAL = base.register(base.Family(
    model_type="mixtral", architecture="MixtralForCausalLM",
    defaults=dict(rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=131072,
                  num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                  router_aux_loss_coef=0.001),
    values=_values,
    claims=lambda cfg: (base.routed(cfg) and not cfg.qkv_bias and not cfg.qk_norm
                        and not cfg.qk_norm_full),
    to_hf=_to_hf,
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **_MOE_MLP}))
