"""Llama (LlamaForCausalLM): RoPE, with Llama 3.x's and other context-extension schemes
(models/rope.py), RMSNorm, SwiGLU, no biases. Llama 3.1-3.3 and SmolLM2 are this family."""

from models.families import base

LLAMA = base.register(base.Family(
    model_type="llama", architecture="LlamaForCausalLM",
    defaults=dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                  num_key_value_heads=None),
    values=lambda hf, get, source: base.llama_checks(hf, source) or {},
    claims=lambda cfg: (base.dense_llama(cfg) and not cfg.qkv_bias and not cfg.qk_norm
                        and not cfg.sliding_window),
    to_hf=lambda cfg, hf: {**hf, "attention_bias": False, "mlp_bias": False},
    layer_names=lambda cfg: {**base.ATTENTION, **base.NORMS, **base.DENSE_MLP}))
